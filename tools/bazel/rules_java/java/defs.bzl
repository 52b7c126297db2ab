"""The part of @rules_java that Bazel 4's own @bazel_tools//tools/jdk package loads.

Toolchain resolution for py_binary and py_test reads every registered toolchain, Bazel's JDK
toolchains (@bazel_tools//tools/jdk:all) among them, whose BUILD file loads
@rules_java//java:defs.bzl; Bazel's default WORKSPACE would download rules_java from GitHub for
that. Bazel 4 still has the Java rules built in, so this repository, registered under the name
rules_java in WORKSPACE, re-exports them and the build needs no network. Nothing here builds Java.
"""

java_binary = native.java_binary
java_import = native.java_import
java_library = native.java_library
java_lite_proto_library = native.java_lite_proto_library
java_proto_library = native.java_proto_library
java_runtime = native.java_runtime
java_test = native.java_test
java_toolchain = native.java_toolchain
java_package_configuration = native.java_package_configuration
java_plugin = native.java_plugin
