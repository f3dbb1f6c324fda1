#include "support/tensorboard_events.h"

#ifndef FULGUR_TEST_NO_PROTOBUF
#include <google/protobuf/compiler/importer.h>
#include <google/protobuf/dynamic_message.h>
#endif
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <stdexcept>

namespace fulgur::test::tb {

namespace {

uint32_t reference_crc32c(const std::string& bytes) {
  uint32_t crc = 0xffffffffu;
  for (unsigned char byte : bytes) {
    crc ^= byte;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82f63b78u & (0u - (crc & 1u)));
  }
  return ~crc;
}

uint32_t masked(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

uint64_t read_le(const std::string& bytes, size_t at, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= uint64_t{static_cast<unsigned char>(bytes[at + i])} << (8 * i);
  return v;
}

const Message::Field* field(const Message& m, const char* name) {
  const auto it = m.fields.find(name);
  if (it == m.fields.end()) {
    ADD_FAILURE() << m.type << " has no field " << name;
    return nullptr;
  }
  return &it->second;
}

const Message& empty() {
  static const Message none{"(absent)", {}};
  return none;
}

}  // namespace

bool has(const Message& m, const char* name) {
  const auto* f = field(m, name);
  return f != nullptr && f->present;
}

double number(const Message& m, const char* name) { return number_at(m, name, 0); }

std::string text(const Message& m, const char* name) {
  const auto* f = field(m, name);
  if (f == nullptr || f->texts.empty()) {
    if (f != nullptr) ADD_FAILURE() << m.type << "." << name << " is not a string";
    return {};
  }
  return f->texts.front();
}

const Message& sub(const Message& m, const char* name) { return at(m, name, 0); }

int count(const Message& m, const char* name) {
  const auto* f = field(m, name);
  if (f == nullptr) return 0;
  return static_cast<int>(f->numbers.size() + f->texts.size() + f->messages.size());
}

const Message& at(const Message& m, const char* name, int i) {
  const auto* f = field(m, name);
  if (f == nullptr) return empty();
  if (i < 0 || static_cast<size_t>(i) >= f->messages.size()) {
    ADD_FAILURE() << m.type << "." << name << " has no message at " << i << " (holds "
                  << f->messages.size() << ")";
    return empty();
  }
  return *f->messages[static_cast<size_t>(i)];
}

double number_at(const Message& m, const char* name, int i) {
  const auto* f = field(m, name);
  if (f == nullptr) return 0;
  if (i < 0 || static_cast<size_t>(i) >= f->numbers.size()) {
    ADD_FAILURE() << m.type << "." << name << " has no number at " << i << " (holds "
                  << f->numbers.size() << ")";
    return 0;
  }
  return f->numbers[static_cast<size_t>(i)];
}

#ifdef FULGUR_TEST_NO_PROTOBUF

bool available() { return false; }
std::string why_not() {
  return "this LibTorch bundles its own protobuf (" FULGUR_TEST_NO_PROTOBUF "), so the test's "
         "decoder is not linked; event files are checked by their framing only";
}
struct Decoder::Impl {};
Decoder::Decoder() { throw std::logic_error(why_not()); }
Decoder::~Decoder() = default;
std::unique_ptr<Message> Decoder::parse(const std::string&, const std::string&) {
  throw std::logic_error(why_not());
}

#else

bool available() { return true; }
std::string why_not() { return {}; }

namespace pb = google::protobuf;

namespace {

double scalar(const pb::Message& m, const pb::FieldDescriptor* f, int i) {
  const auto* r = m.GetReflection();
  const bool rep = f->is_repeated();
  switch (f->cpp_type()) {
    case pb::FieldDescriptor::CPPTYPE_DOUBLE: return rep ? r->GetRepeatedDouble(m, f, i) : r->GetDouble(m, f);
    case pb::FieldDescriptor::CPPTYPE_FLOAT: return rep ? r->GetRepeatedFloat(m, f, i) : r->GetFloat(m, f);
    case pb::FieldDescriptor::CPPTYPE_INT64:
      return static_cast<double>(rep ? r->GetRepeatedInt64(m, f, i) : r->GetInt64(m, f));
    case pb::FieldDescriptor::CPPTYPE_UINT64:
      return static_cast<double>(rep ? r->GetRepeatedUInt64(m, f, i) : r->GetUInt64(m, f));
    case pb::FieldDescriptor::CPPTYPE_INT32: return rep ? r->GetRepeatedInt32(m, f, i) : r->GetInt32(m, f);
    case pb::FieldDescriptor::CPPTYPE_UINT32: return rep ? r->GetRepeatedUInt32(m, f, i) : r->GetUInt32(m, f);
    case pb::FieldDescriptor::CPPTYPE_BOOL: return (rep ? r->GetRepeatedBool(m, f, i) : r->GetBool(m, f)) ? 1 : 0;
    case pb::FieldDescriptor::CPPTYPE_ENUM:
      return rep ? r->GetRepeatedEnumValue(m, f, i) : r->GetEnumValue(m, f);
    default: return 0;
  }
}

std::shared_ptr<const Message> convert(const pb::Message& m) {
  auto out = std::make_shared<Message>();
  const pb::Descriptor* d = m.GetDescriptor();
  const auto* r = m.GetReflection();
  out->type = d->name();
  for (int k = 0; k < d->field_count(); ++k) {
    const pb::FieldDescriptor* f = d->field(k);
    Message::Field& field = out->fields[f->name()];
    field.repeated = f->is_repeated();
    const int n = field.repeated ? r->FieldSize(m, f) : 1;
    field.present = field.repeated ? n > 0 : r->HasField(m, f);
    for (int i = 0; i < n; ++i) {
      if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) {
        if (field.repeated) {
          field.messages.push_back(convert(r->GetRepeatedMessage(m, f, i)));
        } else if (field.present) {
          field.messages.push_back(convert(r->GetMessage(m, f)));
        }
      } else if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_STRING) {
        field.texts.push_back(field.repeated ? r->GetRepeatedString(m, f, i) : r->GetString(m, f));
      } else {
        field.numbers.push_back(scalar(m, f, i));
      }
    }
  }
  return out;
}

}  // namespace

struct Decoder::Impl {
  struct NoErrors : pb::compiler::MultiFileErrorCollector {
    void AddError(const std::string& file, int line, int, const std::string& message) override {
      ADD_FAILURE() << file << ":" << line << ": " << message;
    }
  };
  pb::compiler::DiskSourceTree tree;
  NoErrors errors;
  pb::compiler::Importer importer{&tree, &errors};
  pb::DynamicMessageFactory factory;
};

Decoder::Decoder() : impl_(std::make_unique<Impl>()) {
  impl_->tree.MapPath("", FULGUR_TEST_PROTO_DIR);
  impl_->tree.MapPath("", FULGUR_PROTOBUF_INCLUDE_DIR);
  EXPECT_NE(impl_->importer.Import("tensorboard_events.proto"), nullptr);
}

Decoder::~Decoder() = default;

std::unique_ptr<Message> Decoder::parse(const std::string& type, const std::string& bytes) {
  const pb::Descriptor* d = impl_->importer.pool()->FindMessageTypeByName("fulgur_test." + type);
  EXPECT_NE(d, nullptr) << type;
  if (d == nullptr) return std::make_unique<Message>(empty());
  std::unique_ptr<pb::Message> m(impl_->factory.GetPrototype(d)->New());
  EXPECT_TRUE(m->ParseFromString(bytes)) << "not a " << type;
  return std::make_unique<Message>(*convert(*m));
}

#endif  // FULGUR_TEST_NO_PROTOBUF

std::vector<std::string> read_records(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string bytes = ss.str();
  std::vector<std::string> records;
  size_t at = 0;
  while (at < bytes.size()) {
    EXPECT_LE(at + 12, bytes.size()) << path << ": a record header cut at byte " << at;
    if (at + 12 > bytes.size()) break;
    const uint64_t length = read_le(bytes, at, 8);
    EXPECT_EQ(read_le(bytes, at + 8, 4), masked(reference_crc32c(bytes.substr(at, 8))))
        << path << ": the length CRC of the record at byte " << at;
    EXPECT_LE(at + 12 + length + 4, bytes.size()) << path << ": a record cut at byte " << at;
    if (at + 12 + length + 4 > bytes.size()) break;
    std::string data = bytes.substr(at + 12, length);
    EXPECT_EQ(read_le(bytes, at + 12 + length, 4), masked(reference_crc32c(data)))
        << path << ": the data CRC of the record at byte " << at;
    records.push_back(std::move(data));
    at += 12 + length + 4;
  }
  return records;
}

}  // namespace fulgur::test::tb
