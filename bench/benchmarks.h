// The benchmarks of the `fulgur_bench` program (bench/main.cpp): each is run
// as `fulgur_bench <name> [options]` and gets argv from its name on (argv[0]
// is the benchmark's name). Each source says what it measures and how.
#pragma once

namespace fulgur_bench {

namespace activations {
int run(int argc, char** argv);
}
namespace checkpoint {
int run(int argc, char** argv);
}
namespace data_workers {
int run(int argc, char** argv);
}
namespace ddp {
int run(int argc, char** argv);
}
namespace fsdp {
int run(int argc, char** argv);
}
namespace gpu {
int run(int argc, char** argv);
}
namespace optimizers {
int run(int argc, char** argv);
}
namespace overhead {
int run(int argc, char** argv);
}
namespace restart {
int run(int argc, char** argv);
}
namespace startup {
int run(int argc, char** argv);
}

}  // namespace fulgur_bench
