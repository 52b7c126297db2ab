"""Bazel ``py_test`` entry point: runs the pytest file(s) given as arguments."""

import sys

import pytest

if __name__ == "__main__":
    sys.exit(pytest.main(sys.argv[1:]))
