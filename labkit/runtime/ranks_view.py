"""How a `%%ranks` cell shows its ranks: live, one column per rank in JupyterLab (an HTML display
updated in place, with rank-prefixed lines as its text form), rank-prefixed lines elsewhere; and
under each rank what the cell cost it: time, collectives (count and bytes per kind) and peak
memory.
"""
from __future__ import annotations

import html
import sys
import time

SHOWN_LINES = 200            # per rank and cell; earlier lines are counted, not shown
UPDATE_EVERY = 0.2           # seconds between redraws of the live display


def fmt_bytes(n: float | None) -> str:
    """Binary units, as memory is counted: '8 B', '1.5 KiB', '251 MiB', '1.20 GiB'."""
    if n is None:
        return "?"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:.2f} {unit}" if abs(v) < 10 else f"{v:.0f} {unit}" if abs(v) >= 100 \
                else f"{v:.1f} {unit}"
    return f"{n:.0f} B"


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "?"
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.2f} s"


def collectives_text(by_kind: dict | None) -> str:
    if by_kind is None:
        return "collectives not counted"
    if not by_kind:
        return "no collectives"
    return ", ".join(f"{kind} {n}\u00d7 {fmt_bytes(b)}" for kind, (n, b) in by_kind.items())


def memory_text(rc) -> str:
    if rc.cuda_peak is not None:
        return f"CUDA peak {fmt_bytes(rc.cuda_peak)}"
    if rc.peak_rss is None:
        return "peak memory not measured here (needs Linux)"
    grew = rc.peak_rss - (rc.rss_start or rc.peak_rss)
    return f"peak RSS {fmt_bytes(rc.peak_rss)} (+{fmt_bytes(grew)})"


def stats_text(rc) -> str:
    """One rank's cost of one cell, in one line."""
    if rc.wall is None:
        return "did not answer"
    head = ("interrupted" if rc.interrupted else f"raised {rc.error['type']}" if rc.error
            else "ok")
    return " \u00b7 ".join([f"{head} in {fmt_seconds(rc.wall)}", collectives_text(rc.collectives),
                            memory_text(rc)])


def in_notebook() -> bool:
    """A Jupyter kernel (displays can be updated in place), not a terminal."""
    try:
        from IPython import get_ipython
        shell = get_ipython()
    except ImportError:
        return False
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


class PlainLines:
    """Rank-prefixed lines as they come (a terminal, a script, pytest)."""

    def __call__(self, rank: int, text: str, dest: str) -> None:
        stream = sys.stdout if dest == "stdout" else sys.stderr
        stream.write(f"[rank {rank}] {text}\n")
        stream.flush()

    def tick(self) -> None:
        pass

    def finish(self, result=None) -> None:
        if result is not None:
            for r in result.ranks:
                print(f"[rank {r}] {stats_text(result.by_rank[r])}")


class Columns:
    """One column per rank, redrawn in place at most every UPDATE_EVERY s while the cell runs;
    under each column what the cell cost that rank."""

    def __init__(self, ranks: list[int]):
        from IPython.display import display
        self.ranks = list(ranks)
        self.lines: list[tuple[int, str, str]] = []       # (rank, text, dest) in arrival order
        self.drawn, self.dirty = 0.0, False
        self.handle = display(self._bundle(None), raw=True, display_id=True)

    def __call__(self, rank: int, text: str, dest: str) -> None:
        if rank not in self.ranks:          # a line of a rank outside this cell (a leftover)
            self.ranks.append(rank)
        self.lines.append((rank, text, dest))
        self.dirty = True
        self.tick()

    def tick(self) -> None:
        if self.dirty and time.monotonic() - self.drawn > UPDATE_EVERY:
            self._draw(None)

    def finish(self, result=None) -> None:
        self._draw(result)

    def _draw(self, result) -> None:
        self.handle.update(self._bundle(result), raw=True)
        self.drawn, self.dirty = time.monotonic(), False

    def _bundle(self, result) -> dict:
        return {"text/plain": self._text(result), "text/html": self._html(result)}

    def _text(self, result) -> str:
        out = [f"[rank {r}] {t}" for r, t, _ in self.lines]
        if result is not None:
            out += [f"[rank {r}] {stats_text(result.by_rank[r])}" for r in result.ranks]
        return "\n".join(out) or "(running on ranks " + ", ".join(map(str, self.ranks)) + ")"

    def _html(self, result) -> str:
        cols = []
        for r in self.ranks:
            mine = [(t, d) for rank, t, d in self.lines if rank == r]
            hidden = max(0, len(mine) - SHOWN_LINES)
            body = "".join(
                f'<span style="color:var(--jp-error-color1,#b00)">{html.escape(t)}</span>\n'
                if d == "stderr" else html.escape(t) + "\n" for t, d in mine[hidden:])
            if hidden:
                body = f"<i>({hidden} earlier lines not shown)</i>\n" + body
            rc = result.by_rank.get(r) if result is not None else None
            foot = ("running\u2026" if result is None else
                    html.escape(stats_text(rc)) if rc is not None else "")
            bad = rc is not None and (rc.error or rc.wall is None)
            color = "var(--jp-error-color1,#b00)" if bad else "var(--jp-ui-font-color2,#555)"
            pre = ('<pre style="margin:0;padding:4px 6px;white-space:pre-wrap;word-break:'
                   f'break-word;max-height:24em;overflow-y:auto">{body}</pre>' if body else "")
            cols.append(
                '<div style="border:1px solid var(--jp-border-color2,#ccc);border-radius:4px;'
                'min-width:0"><div style="font-weight:600;padding:2px 6px;background:'
                f'var(--jp-layout-color2,#f3f3f3)">rank {r}</div>{pre}'
                '<div style="font-size:85%;padding:2px 6px;border-top:1px solid '
                f'var(--jp-border-color3,#eee);color:{color}">{foot}</div></div>')
        n = len(self.ranks)
        return (f'<div class="labkit-ranks" style="display:grid;grid-template-columns:repeat({n},'
                'minmax(13em,1fr));gap:6px;overflow-x:auto">' + "".join(cols) + "</div>")


def live_view(ranks: list[int]):
    """Columns in a Jupyter kernel, PlainLines elsewhere."""
    return Columns(ranks) if in_notebook() else PlainLines()


def status_text(world) -> str:
    """What `%ranks status` prints."""
    if world is None or world.job is None:
        return "no ranks are running (start them with `%ranks start -n 4`)"
    up = time.time() - (world.started_at or time.time())
    lines = [f"{world.options()}; up {fmt_seconds(up)}, {world.cells} cell(s) run"
             + (f", started again {world.restarts} time(s)" if world.restarts else "")]
    lines.append(f"{'rank':>4}  {'pid':>7}  {'alive':>5}  {'memory (RSS)':>12}  last cell")
    for row in world.status():
        last = (f"{row['last_cell']}: {row['last_outcome']}" if row["last_cell"] is not None
                else "-")
        lines.append(f"{row['rank']:>4}  {row['pid'] or '-':>7}  "
                     f"{'yes' if row['alive'] else 'NO':>5}  {fmt_bytes(row['rss']):>12}  {last}")
    return "\n".join(lines)
