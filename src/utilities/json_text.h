#pragma once
// A string as a JSON string literal, for the JSON fulgur writes by hand
// (the connector's report, `fulgur resolve`; the pytorch profiler's trace
// without Kineto): quotes, backslashes and control characters escaped.

#include <cstdio>
#include <string>
#include <string_view>

namespace fulgur::detail {

/// Appends `text` to `out` as a quoted JSON string.
inline void append_json_string(std::string& out, std::string_view text) {
  out += '"';
  for (const char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
          out += buf;
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

/// `text` as a quoted JSON string.
inline std::string json_string(std::string_view text) {
  std::string out;
  append_json_string(out, text);
  return out;
}

}  // namespace fulgur::detail
