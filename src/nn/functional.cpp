#include "fulgur/nn/functional.h"

#include <torch/torch.h>

#include "fulgur/core/errors.h"
#include "fulgur/distributed/process_group.h"

namespace fulgur::nn {

namespace {

// Carries the all-reduce to backward (saved_data holds only IValues).
struct AllReduceHolder : torch::CustomClassHolder {
  explicit AllReduceHolder(AllReduceSum f) : fn(std::move(f)) {}
  AllReduceSum fn;
};

struct AllReduceSumFunction : torch::autograd::Function<AllReduceSumFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            c10::intrusive_ptr<AllReduceHolder> holder) {
    at::Tensor out = x.contiguous().clone();
    holder->fn(out);
    ctx->saved_data["all_reduce"] = c10::IValue::make_capsule(holder);
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto holder = c10::static_intrusive_pointer_cast<AllReduceHolder>(
        ctx->saved_data["all_reduce"].toCapsule());
    at::Tensor grad = grads[0].contiguous().clone();
    holder->fn(grad);
    return {grad, at::Tensor()};
  }
};

}  // namespace

at::Tensor all_reduce_sum(const at::Tensor& x, AllReduceSum all_reduce) {
  FULGUR_ASSERT(all_reduce != nullptr, "all_reduce_sum needs an all-reduce");
  return AllReduceSumFunction::apply(x,
                                     c10::make_intrusive<AllReduceHolder>(std::move(all_reduce)));
}

at::Tensor all_reduce_sum(const at::Tensor& x, std::shared_ptr<ProcessGroup> group) {
  if (!group) {
    throw ConfigError(
        "fulgur::nn::all_reduce_sum(x, group): the group is null. Pass the "
        "strategy's (Strategy::shared_process_group()) or your own.");
  }
  return all_reduce_sum(x, [group](at::Tensor& t) { group->all_reduce_(t, ReduceOp::kSum); });
}

}  // namespace fulgur::nn
