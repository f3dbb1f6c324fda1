// The precompiled header of fulgur's own targets: the heavy LibTorch
// headers every translation unit would otherwise parse (~20 s each).
#pragma once
#include <torch/torch.h>
#include <torch/serialize/archive.h>
