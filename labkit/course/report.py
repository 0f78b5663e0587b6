"""What `labkit grade` reports: a result per check and per exercise, and how it is printed
(a header before the kernel starts, a line per check as it comes, a footer with the summary)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class CheckResult:
    name: str
    exercise: str | None
    passed: bool
    message: str = ""
    seconds: float = 0.0   # the wait for it: seconds since the previous check was decided


@dataclass
class ExerciseResult:
    id: str
    status: str  # "ran" | "not attempted" | "missing" | "error" | "refused" | "timeout" | "not run"
    message: str = ""
    traceback: str = ""


@dataclass
class GradeReport:
    notebook: str
    template: str
    timeout: float = 0.0                            # seconds a cell may run
    names: list[str] = field(default_factory=list)     # the checks, known before they run
    checks: list[CheckResult] = field(default_factory=list)
    exercises: list[ExerciseResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> int:
        return sum(c.passed for c in self.checks)

    @property
    def total(self) -> int:
        return len(self.checks)

    @property
    def ok(self) -> bool:
        return self.total > 0 and self.passed == self.total

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(passed=self.passed, total=self.total, ok=self.ok)
        return d

    def header(self) -> list[str]:
        return [f"Grading {self.notebook}", f"  against {self.template} (a fresh kernel; "
                                            f"at most {self.timeout:g} s per cell)", ""]

    def check_lines(self, c: CheckResult) -> list[str]:
        width = max([len(n) for n in self.names] + [len(c.name), 5])
        msg = c.message.split("\n") if c.message else [""]
        lines = [f"  {c.name:<{width}}  {'PASS' if c.passed else 'FAIL'}  ({c.seconds:.1f} s)  "
                 f"{msg[0]}".rstrip()]
        return lines + [f"  {'':<{width}}        {m}" for m in msg[1:]]

    def footer(self) -> list[str]:
        lines = []
        shown = [e for e in self.exercises if e.traceback]
        if shown:
            lines += ["", "Errors in your exercise cells:"]
            for e in shown:
                lines.append(f"  {e.id}: {e.message}")
                lines += [f"      {t}" for t in e.traceback.split("\n")]
        if self.notes:
            lines += ["", "Notes:"] + [f"  - {n}" for n in self.notes]
        return lines + ["", f"graded in {self.seconds:.1f} s",
                        f"{self.passed}/{self.total} checks passed"
                        + ("" if self.ok else f"; {self.total - self.passed} failed")]

    def format(self) -> str:
        lines = self.header()
        for c in self.checks:
            lines += self.check_lines(c)
        return "\n".join(lines + self.footer())
