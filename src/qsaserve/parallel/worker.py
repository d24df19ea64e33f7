"""Entry point of a spawned rank: `python -m qsaserve.parallel.worker ERROR_FD`, spec pickled on stdin."""
import pickle
import sys

from qsaserve.parallel.executor import worker_main

if __name__ == "__main__":
    worker_main(pickle.loads(sys.stdin.buffer.read()), int(sys.argv[1]))
