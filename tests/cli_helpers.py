"""Assertions shared by the CLI tests (tests/ is on sys.path under pytest's default import mode)."""

from __future__ import annotations


def assert_user_error(result, *fragments: str) -> str:
    """Exit 2, one stderr line ``error: ...`` naming each fragment, nothing on stdout, no traceback."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    assert result.stdout == ""
    return lines[0]
