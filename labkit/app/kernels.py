"""The kernel manager `labkit calculators` gives Voila: at most `max_kernels` kernels (one per
open page); a page asked for beyond that gets a 503 page saying what to do, not a new kernel.
Shutting down the kernels of closed pages is jupyter_server's culling (settings in
labkit/cli/calculators.py). Runs in the Voila server, never in a page's kernel.
"""
from __future__ import annotations

from jupyter_server.services.kernels.kernelmanager import AsyncMappingKernelManager
from tornado.web import HTTPError
from traitlets import Integer

FULL = ("The calculators are full: this server allows {n} open pages at once. Close a "
        "calculators tab you no longer use, wait about {wait} s, then reload this page. "
        "Instructor: restart with a larger --max-kernels (each page takes about 100 MB).")


class CappedKernelManager(AsyncMappingKernelManager):
    """AsyncMappingKernelManager that refuses a new kernel once max_kernels run (or start)."""

    max_kernels = Integer(40, config=True, help="most kernels at once; 0 for no cap")
    free_within = Integer(75, config=True, help="seconds a closed page's kernel may live on")
    _starting = 0                           # kernels being started (not yet in the mapping)

    async def start_kernel(self, *, kernel_id=None, path=None, **kwargs):
        if kernel_id is not None and kernel_id in self:
            return await super().start_kernel(kernel_id=kernel_id, path=path, **kwargs)
        running = len(self) + self._starting
        if 0 < self.max_kernels <= running:
            self.log.warning("labkit calculators: refused a page: %d kernels run "
                             "(--max-kernels %d)", running, self.max_kernels)
            raise HTTPError(503, reason=FULL.format(n=self.max_kernels, wait=self.free_within))
        self._starting += 1
        try:
            return await super().start_kernel(kernel_id=kernel_id, path=path, **kwargs)
        finally:
            self._starting -= 1
