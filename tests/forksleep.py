"""A child for tests/test_forkserver.py that waits until it is signalled."""

import time

if __name__ == "__main__":
    time.sleep(600)
