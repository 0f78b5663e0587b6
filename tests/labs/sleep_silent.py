"""A lab whose ranks sleep without printing (tests/test_orphans.py): a rank that writes nothing
never learns from a broken pipe that the kernel that launched it is gone."""
import os
import time

from labkit.runtime import dist

ctx = dist.setup()
dist.report(pid=os.getpid())
marker = os.environ.get("LABKIT_TEST_MARKER")
if marker:
    with open(f"{marker}.{ctx.rank}", "w") as f:    # the test waits for every rank's file
        f.write(str(os.getpid()))
time.sleep(float(os.environ.get("LABKIT_TEST_SLEEP", "120")))
dist.shutdown()
