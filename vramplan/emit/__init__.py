"""Emitters: pure functions from a Plan to the files a user launches (no I/O inside)."""
