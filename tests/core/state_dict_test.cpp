// StateDict: entries keep the order they were first set in (a key set again
// keeps its place); sections nest and carry their path into every error; a
// required read names the entry's full path, what it found and, for a
// missing entry, what the dict holds; what a checkpoint cannot hold is
// refused when it is set; copies are deep; transform_tensors and
// for_each_tensor reach every tensor (sections, lists, tuples, dicts); and
// the LibTorch archive conversion is lossless both ways, with archives
// written by LibTorch itself too.
#include "fulgur/core/state_dict.h"

#include <gtest/gtest.h>
#include <torch/script.h>
#include <torch/torch.h>

#include <cstdint>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "fulgur/fulgur.h"
#include "support/test_support.h"

namespace {

using Keys = std::vector<std::string>;

TEST(StateDict, KeepsTheOrderOfFirstSetAndASetKeyKeepsItsPlace) {
  fulgur::StateDict state;
  EXPECT_TRUE(state.empty());
  state.set("b", int64_t{1});
  state.set("a", 2.5);
  state.section("c").set("x", int64_t{0});
  state.set("d", true);
  state.set("b", std::string("again"));  // replaced in place
  EXPECT_EQ(state.keys(), (Keys{"b", "a", "c", "d"}));
  EXPECT_EQ(state.size(), 4u);
  EXPECT_FALSE(state.empty());
  EXPECT_EQ(state.string("b"), "again");
  // A value replaced by a section, and a section by a value: still in place.
  state.section("a").set("y", int64_t{1});
  EXPECT_EQ(state.keys(), (Keys{"b", "a", "c", "d"}));
  EXPECT_EQ(state.find("a"), nullptr);
  ASSERT_NE(state.find_section("a"), nullptr);
  EXPECT_EQ(state.section_at("a").integer("y"), 1);
  state.set("c", int64_t{3});
  EXPECT_EQ(state.keys(), (Keys{"b", "a", "c", "d"}));
  EXPECT_EQ(state.find_section("c"), nullptr);
  EXPECT_EQ(state.integer("c"), 3);
  // section() of an existing section gives it back, entries and all.
  state.section("a").set("z", int64_t{2});
  EXPECT_EQ(state.section_at("a").keys(), (Keys{"y", "z"}));
}

TEST(StateDict, SectionsNestAndCarryTheirPath) {
  fulgur::StateDict state;
  EXPECT_EQ(state.path(), "");
  fulgur::StateDict& c = state.section("a").section("b").section("c");
  EXPECT_EQ(state.section_at("a").path(), "a");
  EXPECT_EQ(state.section_at("a").section_at("b").path(), "a/b");
  EXPECT_EQ(c.path(), "a/b/c");
  c.set("x", int64_t{1});
  EXPECT_EQ(state.section_at("a").section_at("b").section_at("c").integer("x"), 1);
  EXPECT_THROWS_WITH(fulgur::CheckpointError, c.integer("missing"),
                     {"\"a/b/c/missing\"", "(an integer) is missing", "\"a/b/c\" holds x"});
  EXPECT_THROWS_WITH(fulgur::CheckpointError, c.tensor("x"),
                     {"\"a/b/c/x\"", "is an integer (1)", "where a tensor was expected"});
  // A dict set as a section takes the path of the key it is under, its own
  // sections too.
  fulgur::StateDict inner;
  inner.section("deep").set("v", int64_t{2});
  EXPECT_EQ(inner.section_at("deep").path(), "deep");
  state.section("x").set_section("y", inner);
  const fulgur::StateDict& moved = state.section_at("x").section_at("y");
  EXPECT_EQ(moved.path(), "x/y");
  EXPECT_EQ(moved.section_at("deep").path(), "x/y/deep");
  EXPECT_THROWS_WITH(fulgur::CheckpointError, moved.section_at("deep").string("v"),
                     {"\"x/y/deep/v\"", "is an integer (2)", "where a string was expected"});
  // set_path renames a whole tree.
  fulgur::StateDict tree;
  tree.section("s").set("v", int64_t{1});
  tree.set_path("checkpoint");
  EXPECT_EQ(tree.section_at("s").path(), "checkpoint/s");
  EXPECT_THROWS_WITH(fulgur::CheckpointError, tree.section_at("s").integer("w"),
                     {"\"checkpoint/s/w\"", "\"checkpoint/s\" holds v"});
}

// A dict with an entry of every kind, under "outer".
fulgur::StateDict every_kind() {
  fulgur::StateDict state;
  fulgur::StateDict& outer = state.section("outer");
  outer.set("n", int64_t{5});
  outer.set("t", torch::zeros({2, 3}));
  outer.set("s", std::string("x"));
  outer.set("d", 2.5);
  outer.set("b", true);
  outer.set("il", std::vector<int64_t>{1, 2});
  outer.set("dl", std::vector<double>{0.5, 1.5});
  outer.set("sl", c10::IValue(c10::List<std::string>({"a", "b.c"})));
  outer.section("sub").set("v", int64_t{1});
  return state;
}

TEST(StateDict, EachTypedReadNamesThePathAndWhatItFound) {
  const fulgur::StateDict state = every_kind();
  const fulgur::StateDict& o = state.section_at("outer");
  // What each holds reads back.
  EXPECT_EQ(o.integer("n"), 5);
  EXPECT_TRUE(torch::equal(o.tensor("t"), torch::zeros({2, 3})));
  EXPECT_EQ(o.string("s"), "x");
  EXPECT_EQ(o.real("d"), 2.5);
  EXPECT_EQ(o.real("n"), 5.0);  // an integer is a number too
  EXPECT_TRUE(o.boolean("b"));
  EXPECT_EQ(o.integers("il"), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(o.reals("dl"), (std::vector<double>{0.5, 1.5}));
  EXPECT_EQ(o.strings("sl"), (std::vector<std::string>{"a", "b.c"}));
  EXPECT_EQ(o.at("n").toInt(), 5);
  EXPECT_EQ(o.section_at("sub").integer("v"), 1);
  // Another kind: the path, what is there, what was expected.
  EXPECT_THROWS_WITH(fulgur::CheckpointError, o.tensor("n"),
                     {"\"outer/n\"", "is an integer (5)", "where a tensor was expected"});
  EXPECT_THROWS_WITH(fulgur::CheckpointError, o.integer("t"),
                     {"\"outer/t\"", "is a tensor (Float[2, 3])", "where an integer was expected"});
  EXPECT_THROWS_WITH(fulgur::CheckpointError, o.integer("d"),
                     {"\"outer/d\"", "is a number (2.5)", "where an integer was expected"});
  EXPECT_THROWS_WITH(fulgur::CheckpointError, o.real("s"),
                     {"\"outer/s\"", "is a string (\"x\")", "where a number was expected"});
  EXPECT_THROWS_WITH(fulgur::CheckpointError, o.boolean("d"),
                     {"\"outer/d\"", "is a number (2.5)", "where a bool was expected"});
  EXPECT_THROWS_WITH(fulgur::CheckpointError, o.string("b"),
                     {"\"outer/b\"", "is a bool (true)", "where a string was expected"});
  EXPECT_THROWS_WITH(fulgur::CheckpointError, o.integers("dl"),
                     {"\"outer/dl\"", "where a list of integers was expected"});
  EXPECT_THROWS_WITH(fulgur::CheckpointError, o.integers("n"),
                     {"\"outer/n\"", "is an integer (5)", "where a list of integers was expected"});
  EXPECT_THROWS_WITH(fulgur::CheckpointError, o.reals("il"),
                     {"\"outer/il\"", "where a list of numbers was expected"});
  EXPECT_THROWS_WITH(fulgur::CheckpointError, o.strings("il"),
                     {"\"outer/il\"", "where a list of strings was expected"});
  EXPECT_THROWS_WITH(
      fulgur::CheckpointError, o.strings("s"),
      {"\"outer/s\"", "is a string (\"x\")", "where a list of strings was expected"});
  EXPECT_THROWS_WITH(fulgur::CheckpointError, o.section_at("n"),
                     {"\"outer/n\"", "is an integer (5)", "where a section was expected"});
  EXPECT_THROWS_WITH(fulgur::CheckpointError, o.tensor("sub"),
                     {"\"outer/sub\"", "is a section", "where a tensor was expected"});
  EXPECT_THROWS_WITH(fulgur::CheckpointError, o.at("sub"),
                     {"\"outer/sub\"", "is a section", "where a value was expected"});
  EXPECT_THROWS_WITH(fulgur::CheckpointError, o.real("sub"),
                     {"\"outer/sub\"", "is a section", "where a number was expected"});
  // Missing: the path, the kind wanted, and every key the dict holds.
  const std::string holds = "\"outer\" holds n, t, s, d, b, il, dl, sl, sub";
  EXPECT_THROWS_WITH(fulgur::CheckpointError, o.tensor("weight"),
                     {"\"outer/weight\"", "(a tensor) is missing", holds});
  EXPECT_THROWS_WITH(fulgur::CheckpointError, o.integer("step"),
                     {"\"outer/step\"", "(an integer) is missing", holds});
  EXPECT_THROWS_WITH(fulgur::CheckpointError, o.real("lr"),
                     {"\"outer/lr\"", "(a number) is missing", holds});
  EXPECT_THROWS_WITH(fulgur::CheckpointError, o.boolean("flag"),
                     {"\"outer/flag\"", "(a bool) is missing", holds});
  EXPECT_THROWS_WITH(fulgur::CheckpointError, o.string("name"),
                     {"\"outer/name\"", "(a string) is missing", holds});
  EXPECT_THROWS_WITH(fulgur::CheckpointError, o.integers("sizes"),
                     {"\"outer/sizes\"", "(a list of integers) is missing", holds});
  EXPECT_THROWS_WITH(fulgur::CheckpointError, o.reals("betas"),
                     {"\"outer/betas\"", "(a list of numbers) is missing", holds});
  EXPECT_THROWS_WITH(fulgur::CheckpointError, o.strings("paths"),
                     {"\"outer/paths\"", "(a list of strings) is missing", holds});
  EXPECT_THROWS_WITH(fulgur::CheckpointError, o.section_at("state"),
                     {"\"outer/state\"", "(a section) is missing", holds});
  EXPECT_THROWS_WITH(fulgur::CheckpointError, o.at("value"),
                     {"\"outer/value\"", "(a value) is missing", holds});
  // At the top: the checkpoint, and an empty one holds nothing.
  EXPECT_THROWS_WITH(fulgur::CheckpointError, state.integer("epoch"),
                     {"\"epoch\"", "is missing", "the checkpoint holds outer"});
  EXPECT_THROWS_WITH(fulgur::CheckpointError, fulgur::StateDict().integer("epoch"),
                     {"\"epoch\"", "is missing", "the checkpoint holds nothing"});
}

TEST(StateDict, FindGivesNullWhereThereIsNoValueOrNoSection) {
  fulgur::StateDict state = every_kind();
  fulgur::StateDict& o = *state.find_section("outer");
  const fulgur::StateDict& co = o;
  // find: values only.
  ASSERT_NE(co.find("n"), nullptr);
  EXPECT_EQ(co.find("n")->toInt(), 5);
  EXPECT_EQ(co.find("missing"), nullptr);
  EXPECT_EQ(co.find("sub"), nullptr);
  // find_section: sections only, const or not.
  ASSERT_NE(co.find_section("sub"), nullptr);
  EXPECT_EQ(co.find_section("sub")->integer("v"), 1);
  EXPECT_EQ(co.find_section("n"), nullptr);
  EXPECT_EQ(co.find_section("missing"), nullptr);
  fulgur::StateDict* sub = o.find_section("sub");
  ASSERT_NE(sub, nullptr);
  sub->set("w", int64_t{2});
  EXPECT_EQ(co.section_at("sub").integer("w"), 2);
  EXPECT_EQ(o.find_section("n"), nullptr);
  EXPECT_EQ(o.find_section("missing"), nullptr);
  // contains: either.
  EXPECT_TRUE(co.contains("n"));
  EXPECT_TRUE(co.contains("sub"));
  EXPECT_FALSE(co.contains("missing"));
  EXPECT_EQ(state.find_section("missing"), nullptr);
}

TEST(StateDict, RefusesTheReservedAndTheEmptyKey) {
  fulgur::StateDict state;
  EXPECT_THROWS_WITH(fulgur::ConfigError, state.set("training", true),
                     {"\"training\"", "reserved by LibTorch's archives"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, state.set_buffer("training", torch::ones({1})),
                     {"\"training\"", "reserved"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, state.section("training"), {"\"training\"", "reserved"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, state.set_section("training", fulgur::StateDict()),
                     {"\"training\"", "reserved"});
  EXPECT_THROWS_WITH(fulgur::ConfigError, state.set("", int64_t{1}), {"\"\"", "is empty"});
  // In a section: where it is.
  EXPECT_THROWS_WITH(fulgur::ConfigError, state.section("callbacks").set("training", true),
                     {"\"training\"", "in \"callbacks\"", "reserved"});
  EXPECT_EQ(state.keys(), (Keys{"callbacks"}));
  EXPECT_TRUE(state.section_at("callbacks").empty());
}

// A module, a custom class: objects a checkpoint cannot hold, refused when
// set (alone or in a list), not when the checkpoint is written.
TEST(StateDict, RefusesAnObject) {
  torch::jit::Module module("Foo");
  fulgur::StateDict state;
  EXPECT_THROWS_WITH(fulgur::ConfigError, state.set("module", c10::IValue(module._ivalue())),
                     {"\"module\"", "which a checkpoint cannot hold"});
  c10::impl::GenericList list(c10::AnyType::get());
  list.push_back(c10::IValue(int64_t{1}));
  list.push_back(c10::IValue(module._ivalue()));
  EXPECT_THROWS_WITH(fulgur::ConfigError, state.section("s").set("list", c10::IValue(list)),
                     {"\"s/list\"", "which a checkpoint cannot hold"});
  EXPECT_FALSE(state.contains("module"));
  EXPECT_FALSE(state.section_at("s").contains("list"));
}

TEST(StateDict, TheBufferMarkIsKeptByCopiesAndClearedByASet) {
  fulgur::StateDict state;
  state.set("weight", torch::ones({2}));
  state.set_buffer("running_mean", torch::zeros({2}));
  state.section("sub").set_buffer("count", torch::zeros({1}));
  EXPECT_FALSE(state.is_buffer("weight"));
  EXPECT_TRUE(state.is_buffer("running_mean"));
  EXPECT_FALSE(state.is_buffer("missing"));
  EXPECT_FALSE(state.is_buffer("sub"));
  const fulgur::StateDict copy = state;
  EXPECT_TRUE(copy.is_buffer("running_mean"));
  EXPECT_FALSE(copy.is_buffer("weight"));
  EXPECT_TRUE(copy.section_at("sub").is_buffer("count"));
  fulgur::StateDict assigned;
  assigned = copy;
  EXPECT_TRUE(assigned.is_buffer("running_mean"));
  EXPECT_TRUE(assigned.section_at("sub").is_buffer("count"));
  const fulgur::StateDict moved = std::move(assigned);
  EXPECT_TRUE(moved.is_buffer("running_mean"));
  EXPECT_TRUE(moved.section_at("sub").is_buffer("count"));
  // set() makes it a plain value again; set_buffer a buffer again.
  state.set("running_mean", torch::zeros({2}));
  EXPECT_FALSE(state.is_buffer("running_mean"));
  state.set_buffer("weight", torch::ones({2}));
  EXPECT_TRUE(state.is_buffer("weight"));
  EXPECT_EQ(state.keys(), (Keys{"weight", "running_mean", "sub"}));
}

// What the archive keeps: a buffer is a module buffer, a tensor set with
// set() a parameter (what nn::Module::save writes).
TEST(StateDict, TheArchiveRecordsBuffersAsModuleBuffers) {
  fulgur::StateDict state;
  state.set("weight", torch::ones({2}));
  state.set_buffer("running_mean", torch::zeros({2}));
  state.section("sub").set_buffer("count", torch::zeros({1}));
  state.section("sub").set("bias", torch::ones({1}));
  std::istringstream bytes(fulgur::to_bytes(state));
  torch::jit::Module archive = torch::jit::load(bytes);
  auto names = [](const auto& list) {
    std::set<std::string> out;
    for (const auto& item : list) out.insert(item.name);
    return out;
  };
  EXPECT_EQ(names(archive.named_parameters(/*recurse=*/false)), std::set<std::string>{"weight"});
  EXPECT_EQ(names(archive.named_buffers(/*recurse=*/false)), std::set<std::string>{"running_mean"});
  const torch::jit::Module sub = archive.attr("sub").toModule();
  EXPECT_EQ(names(sub.named_parameters(/*recurse=*/false)), std::set<std::string>{"bias"});
  EXPECT_EQ(names(sub.named_buffers(/*recurse=*/false)), std::set<std::string>{"count"});
}

// A plain tensor (an optimizer's state) is an attribute of the archive,
// neither parameter nor buffer; the mark travels with copies, and set() or
// set_buffer() replace it.
TEST(StateDict, APlainTensorIsArchivedAsAnAttributeAndItsMarkIsKeptByCopies) {
  fulgur::StateDict state;
  state.set("weight", torch::ones({2}));
  state.set_plain("momentum_buffer", torch::full({2}, 3.0));
  state.section("sub").set_plain("step", torch::full({1}, 7.0));
  EXPECT_TRUE(state.is_plain("momentum_buffer"));
  EXPECT_FALSE(state.is_buffer("momentum_buffer"));
  EXPECT_FALSE(state.is_plain("weight"));
  EXPECT_FALSE(state.is_plain("missing"));
  EXPECT_FALSE(state.is_plain("sub"));
  const fulgur::StateDict copy = state;
  EXPECT_TRUE(copy.is_plain("momentum_buffer"));
  EXPECT_TRUE(copy.section_at("sub").is_plain("step"));

  std::istringstream bytes(fulgur::to_bytes(state));
  torch::jit::Module archive = torch::jit::load(bytes);
  std::set<std::string> parameters, buffers;
  for (const auto& p : archive.named_parameters(/*recurse=*/false)) parameters.insert(p.name);
  for (const auto& b : archive.named_buffers(/*recurse=*/false)) buffers.insert(b.name);
  EXPECT_EQ(parameters, std::set<std::string>{"weight"});
  EXPECT_TRUE(buffers.empty());
  ASSERT_TRUE(archive.hasattr("momentum_buffer"));
  EXPECT_TRUE(torch::equal(archive.attr("momentum_buffer").toTensor(), torch::full({2}, 3.0)));
  const torch::jit::Module sub = archive.attr("sub").toModule();
  EXPECT_TRUE(torch::equal(sub.attr("step").toTensor(), torch::full({1}, 7.0)));
  // Read back, the values are the same (an archive cannot tell the kinds).
  const fulgur::StateDict read = fulgur::from_bytes(fulgur::to_bytes(state));
  EXPECT_TRUE(torch::equal(read.tensor("momentum_buffer"), torch::full({2}, 3.0)));

  state.set("momentum_buffer", torch::zeros({2}));
  EXPECT_FALSE(state.is_plain("momentum_buffer"));
  state.set_plain("weight", torch::ones({2}));
  state.set_buffer("weight", torch::ones({2}));
  EXPECT_FALSE(state.is_plain("weight"));
  EXPECT_TRUE(state.is_buffer("weight"));
}

TEST(StateDict, EraseRemovesAnEntryAndKeepsTheOthersInOrder) {
  fulgur::StateDict state;
  state.set("a", int64_t{1});
  state.section("b").set("x", int64_t{2});
  state.set("c", int64_t{3});
  state.set("d", int64_t{4});
  EXPECT_TRUE(state.erase("b"));
  EXPECT_FALSE(state.erase("b"));
  EXPECT_FALSE(state.erase("missing"));
  EXPECT_EQ(state.keys(), (Keys{"a", "c", "d"}));
  EXPECT_EQ(state.size(), 3u);
  EXPECT_FALSE(state.contains("b"));
  // The entries after it are still found under their keys.
  EXPECT_EQ(state.integer("a"), 1);
  EXPECT_EQ(state.integer("c"), 3);
  EXPECT_EQ(state.integer("d"), 4);
  // Set again, it comes last.
  state.set("b", int64_t{5});
  EXPECT_EQ(state.keys(), (Keys{"a", "c", "d", "b"}));
  EXPECT_EQ(state.integer("b"), 5);
  EXPECT_TRUE(state.erase("a"));
  EXPECT_TRUE(state.erase("c"));
  EXPECT_TRUE(state.erase("d"));
  EXPECT_TRUE(state.erase("b"));
  EXPECT_TRUE(state.empty());
}

TEST(StateDict, CopiesAreDeep) {
  fulgur::StateDict original;
  original.set("n", int64_t{1});
  original.section("s").set("x", int64_t{1});
  original.section("s").section("t").set("y", int64_t{1});

  fulgur::StateDict copy = original;
  copy.set("n", int64_t{2});
  copy.section("s").set("x", int64_t{2});
  copy.section("s").set("new", int64_t{2});
  copy.section("s").section("t").set("y", int64_t{2});
  EXPECT_EQ(original.integer("n"), 1);
  EXPECT_EQ(original.section_at("s").integer("x"), 1);
  EXPECT_FALSE(original.section_at("s").contains("new"));
  EXPECT_EQ(original.section_at("s").section_at("t").integer("y"), 1);

  fulgur::StateDict assigned;
  assigned.set("old", int64_t{0});
  assigned = original;
  EXPECT_EQ(assigned.keys(), (Keys{"n", "s"}));
  original.section("s").erase("x");
  original.section("s").section("t").set("y", int64_t{3});
  EXPECT_EQ(assigned.section_at("s").integer("x"), 1);
  EXPECT_EQ(assigned.section_at("s").section_at("t").integer("y"), 1);
  EXPECT_EQ(assigned.section_at("s").section_at("t").path(), "s/t");

  // A section copied out is independent of its source too.
  fulgur::StateDict section = copy.section_at("s");
  section.set("x", int64_t{9});
  EXPECT_EQ(copy.section_at("s").integer("x"), 2);
}

TEST(StateDict, TransformTensorsReachesEveryTensorAndReplacesIt) {
  at::Tensor list_first = torch::full({1}, 3.0);
  c10::List<at::Tensor> user_list({list_first, torch::full({1}, 4.0)});
  c10::impl::GenericDict user_dict(c10::StringType::get(), c10::TensorType::get());
  user_dict.insert("k", torch::full({1}, 6.0));
  const at::Tensor top = torch::full({1}, 1.0);

  fulgur::StateDict state;
  state.set("t", top);
  state.set("n", int64_t{8});
  state.section("s").section("deeper").set("u", torch::full({1}, 2.0));
  state.set("list", c10::IValue(user_list));
  state.set("tuple", c10::ivalue::Tuple::create(c10::IValue(torch::full({1}, 5.0)),
                                                c10::IValue(int64_t{7})));
  state.set("dict", c10::IValue(user_dict));
  state.set_buffer("buffer", torch::full({1}, 7.0));

  auto values = [](const fulgur::StateDict& s) {
    std::vector<double> out;
    s.for_each_tensor([&out](const at::Tensor& t) { out.push_back(t.item<double>()); });
    return out;
  };
  EXPECT_EQ(values(state), (std::vector<double>{1, 2, 3, 4, 5, 6, 7}));

  std::vector<double> met;
  state.transform_tensors([&met](const at::Tensor& t) {
    met.push_back(t.item<double>());
    return t * 10;
  });
  EXPECT_EQ(met, (std::vector<double>{1, 2, 3, 4, 5, 6, 7}));  // for_each_tensor's order
  EXPECT_EQ(values(state), (std::vector<double>{10, 20, 30, 40, 50, 60, 70}));
  // Replaced, not changed in place; what is not a tensor stays.
  EXPECT_FALSE(state.tensor("t").is_same(top));
  EXPECT_EQ(top.item<double>(), 1.0);
  EXPECT_EQ(state.integer("n"), 8);
  EXPECT_EQ(state.at("tuple").toTupleRef().elements()[1].toInt(), 7);
  EXPECT_TRUE(state.is_buffer("buffer"));
  EXPECT_EQ(state.keys(), (Keys{"t", "n", "s", "list", "tuple", "dict", "buffer"}));
  EXPECT_EQ(state.at("list").toTensorList().size(), 2u);
  EXPECT_EQ(state.at("dict").toGenericDict().at("k").toTensor().item<double>(), 60.0);
  // The containers the user set are not changed.
  EXPECT_TRUE(user_list.get(0).is_same(list_first));
  EXPECT_EQ(user_list.get(1).item<double>(), 4.0);
  EXPECT_EQ(user_dict.at("k").toTensor().item<double>(), 6.0);
}

// A dict with an entry of each kind the archive keeps.
fulgur::StateDict archivable() {
  fulgur::StateDict state;
  state.set("int", int64_t{-3});
  state.set("big", int64_t{1} << 40);
  state.set("real", 0.1);
  state.set("tiny", 1e-300);
  state.set("flag", true);
  state.set("off", false);
  state.set("name", std::string("fulgur \xce\xbb"));
  state.set("ints", std::vector<int64_t>{1, -2, int64_t{1} << 50});
  state.set("reals", std::vector<double>{0.1, -2.5, 1e-300});
  state.set("names", c10::IValue(c10::List<std::string>({"a", "", "b c"})));
  state.set("weight", torch::randn({3, 4}, torch::kDouble));
  state.set("ints32", torch::arange(4, torch::kInt).reshape({2, 2}) - 2);
  state.set("count", torch::arange(5));
  state.set_buffer("running_mean", torch::randn({4}));
  fulgur::StateDict& optimizer = state.section("optimizer");
  optimizer.set("lr", 0.01);
  optimizer.section("state").section("0").set("exp_avg", torch::randn({2}));
  optimizer.section("state").section("0").set("step", int64_t{2});
  state.section("empty");
  return state;
}

// Every entry of `a` and `b`, in order, of the same kind and value (tensors
// bit-identical, of the same dtype and shape).
void expect_same_state(const fulgur::StateDict& a, const fulgur::StateDict& b,
                       const std::string& where) {
  ASSERT_EQ(a.keys(), b.keys()) << where;
  for (const auto& key : a.keys()) {
    const std::string here = where + "/" + key;
    if (const fulgur::StateDict* sa = a.find_section(key)) {
      const fulgur::StateDict* sb = b.find_section(key);
      ASSERT_NE(sb, nullptr) << here << " is not a section";
      expect_same_state(*sa, *sb, here);
      continue;
    }
    const c10::IValue& va = a.at(key);
    const c10::IValue* vb = b.find(key);
    ASSERT_NE(vb, nullptr) << here;
    if (va.isTensor()) {
      ASSERT_TRUE(vb->isTensor()) << here;
      const at::Tensor ta = va.toTensor(), tb = vb->toTensor();
      EXPECT_EQ(ta.scalar_type(), tb.scalar_type()) << here;
      EXPECT_EQ(ta.sizes(), tb.sizes()) << here;
      EXPECT_TRUE(torch::equal(ta, tb)) << here;
    } else if (va.isIntList()) {
      ASSERT_TRUE(vb->isIntList()) << here;
      EXPECT_EQ(va.toIntVector(), vb->toIntVector()) << here;
    } else if (va.isDoubleList()) {
      ASSERT_TRUE(vb->isDoubleList()) << here;
      EXPECT_EQ(va.toDoubleVector(), vb->toDoubleVector()) << here;  // exact
    } else if (va.isList()) {
      ASSERT_TRUE(vb->isList()) << here;
      const auto la = va.toListRef(), lb = vb->toListRef();
      ASSERT_EQ(la.size(), lb.size()) << here;
      for (size_t i = 0; i < la.size(); ++i) {
        ASSERT_TRUE(la[i].isString() && lb[i].isString()) << here << "[" << i << "]";
        EXPECT_EQ(la[i].toStringRef(), lb[i].toStringRef()) << here << "[" << i << "]";
      }
    } else if (va.isInt()) {
      ASSERT_TRUE(vb->isInt()) << here;
      EXPECT_EQ(va.toInt(), vb->toInt()) << here;
    } else if (va.isDouble()) {
      ASSERT_TRUE(vb->isDouble()) << here;
      EXPECT_EQ(va.toDouble(), vb->toDouble()) << here;  // exact
    } else if (va.isBool()) {
      ASSERT_TRUE(vb->isBool()) << here;
      EXPECT_EQ(va.toBool(), vb->toBool()) << here;
    } else if (va.isString()) {
      ASSERT_TRUE(vb->isString()) << here;
      EXPECT_EQ(va.toStringRef(), vb->toStringRef()) << here;
    } else {
      ADD_FAILURE() << here << ": a " << va.tagKind() << ", which this test does not compare";
    }
  }
}

TEST(StateDict, TheArchiveRoundTripKeepsEverything) {
  const fulgur::StateDict state = archivable();
  const fulgur::StateDict loaded = fulgur::from_bytes(fulgur::to_bytes(state));
  expect_same_state(state, loaded, "");
  // Read through the typed accessors too.
  EXPECT_EQ(loaded.integer("int"), -3);
  EXPECT_EQ(loaded.integer("big"), int64_t{1} << 40);
  EXPECT_EQ(loaded.real("real"), 0.1);
  EXPECT_EQ(loaded.real("tiny"), 1e-300);
  EXPECT_TRUE(loaded.boolean("flag"));
  EXPECT_FALSE(loaded.boolean("off"));
  EXPECT_EQ(loaded.string("name"), "fulgur \xce\xbb");
  EXPECT_EQ(loaded.integers("ints"), (std::vector<int64_t>{1, -2, int64_t{1} << 50}));
  EXPECT_EQ(loaded.reals("reals"), (std::vector<double>{0.1, -2.5, 1e-300}));
  EXPECT_EQ(loaded.strings("names"), (std::vector<std::string>{"a", "", "b c"}));
  EXPECT_EQ(loaded.section_at("optimizer").real("lr"), 0.01);
  EXPECT_EQ(loaded.section_at("optimizer").section_at("state").section_at("0").integer("step"), 2);
  EXPECT_TRUE(loaded.section_at("empty").empty());
  EXPECT_FALSE(loaded.contains("training"));  // the archive's own flag
  // The sections read know where they are.
  EXPECT_EQ(loaded.section_at("optimizer").section_at("state").path(), "optimizer/state");
  // And again: the bytes of a loaded state load the same.
  expect_same_state(state, fulgur::from_bytes(fulgur::to_bytes(loaded)), "(twice)");
}

// Keys an archive cannot name an attribute by (a Python keyword, a name
// of its own, a quote, a backslash or a line break): the file saved and
// verified, and its load threw LibTorch's "expected ident but found
// 'class'". Written under another name and read back as they were, in
// sections too (an hparam "class", a callback's JSON-like state_key()).
TEST(StateDict, KeysAnArchiveCannotNameRoundTripThroughIt) {
  const std::vector<std::string> keys = {"class",
                                         "in",
                                         "None",
                                         "__parameters__",
                                         "__annotations__",
                                         "Cb{\"monitor\": \"x\"}",
                                         "back\\slash",
                                         "line\nbreak",
                                         "fulgur_k_00",
                                         "plain",
                                         "with.dot/and space"};
  fulgur::StateDict state;
  for (size_t i = 0; i < keys.size(); ++i) {
    state.set(keys[i], static_cast<int64_t>(i));
    state.section("hparams").set(keys[i], keys[i]);
  }
  state.section("def").set_buffer("in", torch::arange(3));
  const fulgur::StateDict loaded = fulgur::from_bytes(fulgur::to_bytes(state));
  for (size_t i = 0; i < keys.size(); ++i) {
    EXPECT_EQ(loaded.integer(keys[i]), static_cast<int64_t>(i)) << keys[i];
    EXPECT_EQ(loaded.section_at("hparams").string(keys[i]), keys[i]);
  }
  EXPECT_TRUE(torch::equal(loaded.section_at("def").tensor("in"), torch::arange(3)));
  EXPECT_EQ(loaded.section_at("def").path(), "def");
  // Through a checkpoint file too: verified, loaded.
  fulgur::test::TempDir dir;
  fulgur::TorchCheckpointIO io;
  fulgur::StateDict copy = state;
  io.save_checkpoint(copy, dir.file("keys.ckpt"));
  EXPECT_EQ(io.verify(dir.file("keys.ckpt")), "");
  EXPECT_EQ(io.load_checkpoint(dir.file("keys.ckpt")).section_at("hparams").string("class"),
            "class");
}

// An undefined tensor (a callback's history before its first update): named
// with its path at the save, not LibTorch's unnamed error at every save.
TEST(StateDict, AnUndefinedTensorIsNamedAtTheSave) {
  fulgur::StateDict state;
  state.section("callbacks").section("Recorder").set("history", at::Tensor());
  EXPECT_THROWS_WITH(
      fulgur::ConfigError, fulgur::to_bytes(state),
      {"entry \"callbacks/Recorder/history\" is an undefined tensor", "torch::empty({0})"});
}

// An empty list of strings (or numbers) reads back as an empty list of
// that kind.
TEST(StateDict, EmptyListsRoundTripThroughTheArchive) {
  fulgur::StateDict state;
  state.set("names", c10::IValue(c10::List<std::string>()));
  state.set("ints", c10::IValue(c10::List<int64_t>()));
  state.set("reals", c10::IValue(c10::List<double>()));
  const fulgur::StateDict loaded = fulgur::from_bytes(fulgur::to_bytes(state));
  EXPECT_TRUE(loaded.strings("names").empty());
  EXPECT_TRUE(loaded.integers("ints").empty());
  EXPECT_TRUE(loaded.reals("reals").empty());
}

// A checkpoint written with LibTorch's own archive API (as fulgur 0.1 and
// nn::Module::save / Optimizer::save write them) reads as the same state,
// and a state written with write_archive reads with LibTorch's API.
TEST(StateDict, ReadsAndWritesLibTorchArchives) {
  torch::serialize::OutputArchive archive, nested, deeper;
  archive.write("epoch", c10::IValue(int64_t{4}));
  archive.write("weight", torch::arange(4, torch::kFloat));
  archive.write("running", torch::ones({2}), /*is_buffer=*/true);
  deeper.write("x", c10::IValue(std::string("deep")));
  deeper.write("m", torch::full({3}, 2.0));
  nested.write("lr", c10::IValue(0.5));
  nested.write("betas", c10::IValue(std::vector<double>{0.9, 0.999}));
  nested.write("deeper", deeper);
  archive.write("optimizer", nested);
  archive.write("last", c10::IValue(true));
  std::ostringstream out;
  archive.save_to(out);

  std::istringstream in_bytes(out.str());
  torch::serialize::InputArchive in;
  in.load_from(in_bytes);
  const fulgur::StateDict state = fulgur::read_archive(in, "ckpt");
  EXPECT_EQ(state.path(), "ckpt");
  EXPECT_EQ(state.keys(), (Keys{"epoch", "weight", "running", "optimizer", "last"}));
  EXPECT_EQ(state.integer("epoch"), 4);
  EXPECT_TRUE(torch::equal(state.tensor("weight"), torch::arange(4, torch::kFloat)));
  EXPECT_TRUE(torch::equal(state.tensor("running"), torch::ones({2})));
  EXPECT_TRUE(state.boolean("last"));
  const fulgur::StateDict& optimizer = state.section_at("optimizer");
  EXPECT_EQ(optimizer.path(), "ckpt/optimizer");
  EXPECT_EQ(optimizer.keys(), (Keys{"lr", "betas", "deeper"}));
  EXPECT_EQ(optimizer.real("lr"), 0.5);
  EXPECT_EQ(optimizer.reals("betas"), (std::vector<double>{0.9, 0.999}));
  const fulgur::StateDict& deep = optimizer.section_at("deeper");
  EXPECT_EQ(deep.keys(), (Keys{"x", "m"}));
  EXPECT_EQ(deep.string("x"), "deep");
  EXPECT_TRUE(torch::equal(deep.tensor("m"), torch::full({3}, 2.0)));
  EXPECT_THROWS_WITH(fulgur::CheckpointError, deep.integer("y"),
                     {"\"ckpt/optimizer/deeper/y\"", "\"ckpt/optimizer/deeper\" holds x, m"});
  // from_bytes reads the same.
  expect_same_state(state, fulgur::from_bytes(out.str()), "(from_bytes)");

  // The other way: write_archive, read with LibTorch's API.
  torch::serialize::OutputArchive written;
  fulgur::write_archive(state, written);
  std::stringstream written_bytes;
  written.save_to(written_bytes);
  torch::serialize::InputArchive back;
  back.load_from(written_bytes);
  std::vector<std::string> back_keys;
  for (const auto& key : back.keys()) {
    if (key != "training") back_keys.push_back(key);
  }
  EXPECT_EQ(back_keys, (Keys{"epoch", "weight", "running", "optimizer", "last"}));
  c10::IValue epoch, lr, x, last;
  back.read("epoch", epoch);
  EXPECT_EQ(epoch.toInt(), 4);
  back.read("last", last);
  EXPECT_TRUE(last.toBool());
  at::Tensor weight, running, m;
  back.read("weight", weight);
  EXPECT_TRUE(torch::equal(weight, torch::arange(4, torch::kFloat)));
  back.read("running", running, /*is_buffer=*/true);
  EXPECT_TRUE(torch::equal(running, torch::ones({2})));
  torch::serialize::InputArchive back_optimizer, back_deeper;
  back.read("optimizer", back_optimizer);
  back_optimizer.read("lr", lr);
  EXPECT_EQ(lr.toDouble(), 0.5);
  back_optimizer.read("deeper", back_deeper);
  back_deeper.read("x", x);
  EXPECT_EQ(x.toStringRef(), "deep");
  back_deeper.read("m", m);
  EXPECT_TRUE(torch::equal(m, torch::full({3}, 2.0)));
}

}  // namespace
