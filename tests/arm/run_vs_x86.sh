#!/bin/sh
# The Arm program under qemu against the x86 program on the same case files.
#   run_vs_x86.sh prepare HOST_BIN WORK            case files and the x86 outputs in WORK
#   run_vs_x86.sh check HOST_BIN WORK ISA EMULATOR... ARM_PROGRAM
# HOST_BIN holds the x86 build's w4a8moe and tests/w4a8moe_case_tool. `check` runs the Arm
# program with the environment's W4A8MOE_ISA and QEMU_CPU, requires that kernel set ISA ran, and
# compares each output with the x86 one (w4a8moe_case_tool compare; docs/testing.md).
set -eu
mode=$1 host=$2 work=$3
shift 3
tool="$host/tests/w4a8moe_case_tool"
case "$mode" in
  prepare)
    rm -rf "$work" && mkdir -p "$work/cases" "$work/x86"
    "$tool" write "$work/cases" >/dev/null
    for c in "$work"/cases/*.safetensors; do
      "$host/w4a8moe" run --input "$c" --output "$work/x86/$(basename "$c")" --threads 2 2>/dev/null
    done
    echo "prepared $(ls "$work/cases" | wc -l) cases with the x86 program"
    ;;
  check)
    isa=$1
    shift
    out="$work/$isa"
    rm -rf "$out" && mkdir -p "$out"
    status=0
    for c in "$work"/cases/*.safetensors; do
      name=$(basename "$c")
      log=$("$@" run --input "$c" --output "$out/$name" --threads 2 2>&1) || {
        echo "$name: the Arm program failed: $log"
        status=1
        continue
      }
      case "$log" in
        *"kernel set $isa,"*) ;;
        *) echo "$name: expected kernel set $isa: $log"; status=1; continue ;;
      esac
      "$tool" compare "$work/x86/$name" "$out/$name" || status=1
    done
    exit $status
    ;;
  *) echo "usage: $0 prepare|check ..." >&2; exit 2 ;;
esac
