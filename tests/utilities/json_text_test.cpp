// json_string: what fulgur writes as JSON by hand (`fulgur resolve`, the
// connector's report) stays JSON whatever the text holds: quotes and
// control characters escaped, UTF-8 kept, and each byte that is not UTF-8
// (an environment variable or a file may hold any) written as U+FFFD.
#include "utilities/json_text.h"

#include <gtest/gtest.h>

#include <string>

namespace {

using fulgur::detail::json_string;

TEST(JsonText, QuotesBackslashesAndControlCharactersAreEscaped) {
  EXPECT_EQ(json_string("a\"b\\c\nd\te\rf"), "\"a\\\"b\\\\c\\nd\\te\\rf\"");
  EXPECT_EQ(json_string(std::string("\x01\x1f\x7f", 3)), "\"\\u0001\\u001f\\u007f\"");
  EXPECT_EQ(json_string(std::string("a\0b", 3)), "\"a\\u0000b\"");
}

TEST(JsonText, Utf8IsKeptAndEveryByteThatIsNotUtf8BecomesAReplacementCharacter) {
  EXPECT_EQ(json_string("caf\xc3\xa9 \xe6\x97\xa5 \xf0\x9f\x9a\x80"),
            "\"caf\xc3\xa9 \xe6\x97\xa5 \xf0\x9f\x9a\x80\"");
  EXPECT_EQ(json_string("\xff"), "\"\\ufffd\"");
  EXPECT_EQ(json_string("caf\xe9!"), "\"caf\\ufffd!\"");               // Latin-1
  EXPECT_EQ(json_string("\xe6\x97"), "\"\\ufffd\\ufffd\"");           // cut short
  EXPECT_EQ(json_string("\xc0\xaf"), "\"\\ufffd\\ufffd\"");           // overlong '/'
  EXPECT_EQ(json_string("\xed\xa0\x80"), "\"\\ufffd\\ufffd\\ufffd\"");  // a surrogate
  EXPECT_EQ(json_string("\xf4\x90\x80\x80"), "\"\\ufffd\\ufffd\\ufffd\\ufffd\"");  // > U+10FFFF
  EXPECT_EQ(json_string("\x80x"), "\"\\ufffdx\"");                     // a stray continuation
}

}  // namespace
