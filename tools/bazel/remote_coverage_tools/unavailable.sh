#!/usr/bin/env bash
echo "Bazel's coverage tools are not available offline (tools/bazel/remote_coverage_tools);" \
     "measure coverage with pytest-cov in the virtualenv instead." >&2
exit 1
