"""Prints --lines numbered lines per rank as fast as it can (even ones on stdout, odd ones on
stderr), then a last line without a newline (tests/test_faults.py)."""
import argparse
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--lines", type=int, default=1000)
n = parser.parse_args().lines
for i in range(n):
    if i % 2:
        sys.stderr.write(f"err {i}\n")
    else:
        sys.stdout.write(f"out {i}\n")
sys.stdout.write("no newline at the end")
