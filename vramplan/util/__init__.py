"""Shared utilities every stage stands on: the one table of bytes per element and byte formatting
(``units``), the one user-facing error type (``errors``: ``SpecError``, one line, exit 2), the bound
on every number an input file carries (``numbers``), atomic file writes (``fileio``), the library
versions a record carries and the ones the estimates model (``versions``, from package metadata,
never an import) and this machine's GPU and RAM (``machine``, no torch).

May import: nothing else of vramplan (the bottom layer).
"""
