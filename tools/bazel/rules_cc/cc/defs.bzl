"""The part of @rules_cc that Bazel 4's auto-configured C++ toolchain (@local_config_cc) loads.

py_binary and py_test resolve the C++ toolchain, whose generated BUILD file loads
@rules_cc//cc:defs.bzl; Bazel's default WORKSPACE would download rules_cc from GitHub for that.
Bazel 4 still has the C++ rules built in, so this repository, registered under the name rules_cc
in WORKSPACE, re-exports them and the build needs no network. Nothing here compiles C++.
"""

cc_binary = native.cc_binary
cc_import = native.cc_import
cc_library = native.cc_library
cc_proto_library = native.cc_proto_library
cc_test = native.cc_test
cc_toolchain = native.cc_toolchain
cc_toolchain_suite = native.cc_toolchain_suite
fdo_prefetch_hints = native.fdo_prefetch_hints
fdo_profile = native.fdo_profile
objc_import = native.objc_import
objc_library = native.objc_library
