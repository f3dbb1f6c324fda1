#pragma once
// TensorBoard's event files, read independently of fulgur's writer: TFRecord
// framing checked with a bitwise CRC32C, messages decoded by Google's protobuf
// from tests/loggers/tensorboard_events.proto.
//
// No protobuf type appears here: tensorboard_events.cpp is compiled apart from
// everything that includes LibTorch (the library fulgur_test_events), because
// a pip wheel's LibTorch ships its own, older protobuf headers on the include
// path of every target that links torch, and they shadow the system's.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace fulgur::test::tb {

/// One decoded message: every field its type declares, with the values it
/// holds (a singular field holds its default when absent; `present` says
/// whether it was set, as protobuf's HasField does).
struct Message {
  struct Field {
    bool repeated = false;
    bool present = false;
    std::vector<double> numbers;   // numeric, bool and enum fields
    std::vector<std::string> texts;  // string and bytes fields
    std::vector<std::shared_ptr<const Message>> messages;  // message fields (present only)
  };
  std::string type;
  std::map<std::string, Field> fields;
};

/// Whether messages can be decoded in this build: not where LibTorch brings
/// its own protobuf (a pip wheel's exports protobuf 3.13's symbols, which
/// would collide with the system's at run time); then `why_not()` says so
/// and the tests that decode skip (the TFRecord framing is still checked).
bool available();
std::string why_not();

/// A test failure (gtest) when `m` has no field `name`.
bool has(const Message& m, const char* name);
double number(const Message& m, const char* name);
std::string text(const Message& m, const char* name);
const Message& sub(const Message& m, const char* name);
int count(const Message& m, const char* name);
const Message& at(const Message& m, const char* name, int i);
double number_at(const Message& m, const char* name, int i);

/// Parses messages of the package fulgur_test (tensorboard_events.proto).
class Decoder {
 public:
  Decoder();
  ~Decoder();
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;
  /// `type` is the message's name in the package ("Event", "HParamsPluginData").
  std::unique_ptr<Message> parse(const std::string& type, const std::string& bytes);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The records of one event file; every CRC is checked (gtest failures).
std::vector<std::string> read_records(const std::string& path);

}  // namespace fulgur::test::tb
