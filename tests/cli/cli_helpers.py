"""What a CLI test sees of one ``qir`` run: exit code, stdout, stderr."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODELS = HERE / "models.py"


@dataclass
class Result:
    code: int
    out: str
    err: str

    def assert_user_error(self, *words: str) -> None:
        """Exit 1, one line on stderr naming the problem, no traceback."""
        assert self.code == 1, (self.code, self.out, self.err)
        assert "Traceback" not in self.err + self.out
        lines = self.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("qir") and ": error: " in lines[0], self.err
        for w in words:
            assert w in self.err, (w, self.err)
