#include "support/process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace fulgur::test {

namespace {
// Every variable a cluster environment reads: cleared for the child unless
// the test sets it, so the machine's own environment cannot leak in.
const char* const kClusterVariables[] = {"MASTER_ADDR",
                                         "MASTER_PORT",
                                         "WORLD_SIZE",
                                         "RANK",
                                         "LOCAL_RANK",
                                         "LOCAL_WORLD_SIZE",
                                         "NODE_RANK",
                                         "GROUP_RANK",
                                         "TORCHELASTIC_RUN_ID",
                                         "SLURM_NTASKS",
                                         "SLURM_PROCID",
                                         "SLURM_LOCALID",
                                         "SLURM_NODEID",
                                         "SLURM_JOB_ID",
                                         "SLURM_JOB_NAME",
                                         "SLURM_NODELIST",
                                         "OMPI_COMM_WORLD_SIZE",
                                         "OMPI_COMM_WORLD_RANK",
                                         "OMPI_COMM_WORLD_LOCAL_RANK",
                                         "PMI_SIZE",
                                         "PMI_RANK",
                                         "LSB_JOBID",
                                         "FULGUR_HEARTBEAT_FD",
                                         "FULGUR_HEARTBEAT_PID"};
}  // namespace

ProcessResult run_process(const std::vector<std::string>& argv,
                          const std::map<std::string, std::string>& env,
                          std::chrono::seconds timeout, const std::vector<std::string>& unset) {
  // Orphans of the child are re-parented to us, so we can see them.
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);
  int out[2];
  if (::pipe2(out, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  auto start = std::chrono::steady_clock::now();
  pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    ::setpgid(0, 0);
    ::dup2(out[1], STDOUT_FILENO);
    ::dup2(out[1], STDERR_FILENO);
    for (const char* name : kClusterVariables) ::unsetenv(name);
    for (const auto& name : unset) ::unsetenv(name.c_str());
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    ::execvp(args[0], args.data());
    std::fprintf(stderr, "cannot execute %s: %s\n", args[0], std::strerror(errno));
    ::_exit(127);
  }
  ::setpgid(pid, pid);
  ::close(out[1]);
  ProcessResult result;
  int status = 0;
  bool exited = false;
  auto deadline = start + timeout;
  char buf[4096];
  bool open = true;
  while (!exited || open) {
    if (!exited && std::chrono::steady_clock::now() > deadline) {
      result.timed_out = true;
      ::kill(-pid, SIGKILL);
    }
    if (open) {
      pollfd p{out[0], POLLIN, 0};
      if (::poll(&p, 1, 100) > 0) {
        ssize_t n = ::read(out[0], buf, sizeof buf);
        if (n > 0) {
          result.output.append(buf, static_cast<size_t>(n));
        } else if (n == 0 || errno != EINTR) {
          open = false;
        }
      }
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (!exited && ::waitpid(pid, &status, WNOHANG) == pid) exited = true;
    if (exited && open && std::chrono::steady_clock::now() > deadline + std::chrono::seconds(5)) {
      break;  // a grandchild keeps the pipe open: counted below
    }
  }
  ::close(out[0]);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) result.signal = WTERMSIG(status);
  // Whatever is left of the group is an orphan: count it, kill it, reap it.
  for (int i = 0; i < 20 && ::kill(-pid, 0) == 0; ++i) {
    while (::waitpid(-pid, nullptr, WNOHANG) > 0) {
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (::kill(-pid, 0) == 0) {
    result.leftover_processes = 1;
    ::kill(-pid, SIGKILL);
    while (::waitpid(-pid, nullptr, 0) > 0) {
    }
  }
  return result;
}

ProcessResult run_test_alone(const std::string& test, const std::map<std::string, std::string>& env,
                             std::chrono::seconds timeout) {
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) throw std::runtime_error("run_test_alone: cannot read /proc/self/exe");
  self[n] = '\0';
  return run_process({self, "--gtest_filter=" + test}, env, timeout);
}

std::string result_value(const std::string& output, const std::string& key) {
  std::istringstream in(output);
  std::string line;
  // Launchers may prefix lines ("[default0]:" from torchrun).
  const std::string marker = "RESULT " + key + "=";
  std::string value;
  while (std::getline(in, line)) {
    auto at = line.find(marker);
    if (at != std::string::npos) value = line.substr(at + marker.size());
  }
  return value;
}

bool on_path(const std::string& program) {
  return run_process({"sh", "-c", "command -v " + program}, {}, std::chrono::seconds(10))
             .exit_code == 0;
}

std::string torch_python() {
  auto imports_torchrun = [](const std::string& python) {
    return run_process({python, "-c", "import torch.distributed.run"}, {},
                       std::chrono::seconds(60))
               .exit_code == 0;
  };
  auto found = run_process({"sh", "-c", "command -v torchrun"}, {}, std::chrono::seconds(10));
  if (found.exit_code == 0) {
    std::ifstream script(found.output.substr(0, found.output.find_last_not_of("\n") + 1));
    std::string shebang;
    std::getline(script, shebang);
    if (shebang.rfind("#!", 0) == 0) {
      // "#!/path/python3" or "#!/usr/bin/env python3".
      std::istringstream words(shebang.substr(2));
      std::string python;
      words >> python;
      if (python.size() >= 4 && python.compare(python.size() - 4, 4, "/env") == 0) words >> python;
      if (!python.empty() && imports_torchrun(python)) return python;
    }
  }
  return "python3";
}

}  // namespace fulgur::test
