#!/bin/sh
# The tests' C compiler: the real one ($TW_REAL_CC), except that a build whose arguments
# (all but the output path), sources and compiler version match an earlier one copies that
# output (kept in $TW_CC_CACHE). Each engine a test starts has its own cache folder, so the
# C step would otherwise be compiled again for every one of them.
real=${TW_REAL_CC:?}
command -v sha256sum >/dev/null 2>&1 || exec "$real" "$@"  # no hashing: no cache
out=
key=
prev=
for arg in "$@"; do
  if [ "$prev" = "-o" ]; then out=$arg; else key="$key|$arg"; fi
  case $arg in *.c) key="$key|$(sha256sum < "$arg")" ;; esac
  prev=$arg
done
if [ -z "$out" ] || [ -z "${TW_CC_CACHE:-}" ]; then exec "$real" "$@"; fi
key="$key|$("$real" --version 2>&1 | head -n 1)"
hit="$TW_CC_CACHE/$(printf '%s' "$key" | sha256sum | cut -c1-40)"
if [ -f "$hit" ]; then exec cp "$hit" "$out"; fi
"$real" "$@" || exit $?
mkdir -p "$TW_CC_CACHE" && cp "$out" "$hit.$$" && mv -f "$hit.$$" "$hit"
