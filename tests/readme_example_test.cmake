# Checks that the README's first C++ example is examples/minimal/main.cpp
# (less its two leading comment lines), so the documented code is the
# compiled code. Run with -DREADME=... -DEXAMPLE=...
file(READ ${README} readme)
string(FIND "${readme}" "```cpp\n" start)
if(start EQUAL -1)
  message(FATAL_ERROR "${README} has no ```cpp block")
endif()
math(EXPR start "${start} + 7")
string(SUBSTRING "${readme}" ${start} -1 rest)
string(FIND "${rest}" "```" end)
string(SUBSTRING "${rest}" 0 ${end} snippet)
file(STRINGS ${EXAMPLE} lines)
file(READ ${EXAMPLE} example)
string(REGEX REPLACE "^//[^\n]*\n//[^\n]*\n" "" example "${example}")
if(NOT snippet STREQUAL example)
  message(FATAL_ERROR "The README's first ```cpp block differs from ${EXAMPLE}. Copy one "
                      "into the other so the documented example is the compiled one.")
endif()
