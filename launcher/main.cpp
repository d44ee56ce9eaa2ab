// dtrain-run: a thin launcher over mpirun (local and multi-node) and srun (inside a Slurm
// allocation). It forwards DTRAIN_* and NCCL_* variables, binds ranks to NUMA nodes (and
// GPUs under Slurm; under mpirun each rank takes GPU local_rank % GPUs), prints the exact
// command with --dry-run, and with --max-restarts K relaunches a job that died, up to K
// times, from the latest good checkpoint (the program resumes with --resume auto).
//
//   dtrain-run -n 8 --hosts a:4,b:4 -- build/examples/pretrain_gpt --save-dir ckpt ...
//
// Exit codes: the job's (0 done; 75 preempted: not restarted), 2 bad input, 1 when it could
// not be started; after K failed restarts the last failure's code.
#include <CLI/CLI.hpp>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

extern char** environ;

namespace {

constexpr int kExitBadInput = 2;
constexpr int kExitFailure = 1;
constexpr int kExitPreempted = 75;  // pretrain_gpt's code after saving on SIGTERM/SIGUSR1

struct Options {
  int nproc = 0;
  std::string hosts, hostfile;
  std::string launcher = "auto";  // auto | mpirun | srun
  std::string mpirun = "mpirun", srun = "srun";
  std::string bind = "numa";      // numa | core | none
  int gpus_per_node = 0;
  int max_restarts = 0;
  bool dry_run = false;
  std::vector<std::string> env;        // extra variables to forward
  std::vector<std::string> extra;      // extra launcher arguments
  std::vector<std::string> program;    // the program and its arguments
};

struct BadInput : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// "a:4,b:4" -> total slots; BadInput naming the entry when malformed.
int host_slots(const std::string& hosts) {
  int total = 0;
  std::size_t start = 0;
  while (start <= hosts.size()) {
    const auto end = std::min(hosts.find(',', start), hosts.size());
    const auto item = hosts.substr(start, end - start);
    const auto colon = item.find(':');
    int slots = 1;
    bool ok = !item.empty() && colon != 0;
    if (ok && colon != std::string::npos) {
      const auto n = item.substr(colon + 1);
      ok = !n.empty() && n.find_first_not_of("0123456789") == std::string::npos && n.size() < 6;
      slots = ok ? std::stoi(n) : 0;
      ok = ok && slots > 0;
    }
    if (!ok) {
      throw BadInput("--hosts '" + hosts + "': entry '" + item + "' is not allowed; allowed: host or host:slots " +
                     "(slots >= 1), comma-separated, e.g. a:4,b:4");
    }
    total += slots;
    start = end + 1;
  }
  return total;
}

bool forwarded(const std::string& name) {
  return name.rfind("DTRAIN_", 0) == 0 || name.rfind("NCCL_", 0) == 0;
}

// Variable names to forward: DTRAIN_*, NCCL_* and --env, each once, in environment order.
std::vector<std::string> forwarded_names(const Options& o) {
  std::vector<std::string> names;
  auto add = [&](const std::string& n) {
    for (const auto& m : names) {
      if (m == n) return;
    }
    names.push_back(n);
  };
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string item = *e;
    const auto name = item.substr(0, item.find('='));
    if (forwarded(name)) add(name);
  }
  for (const auto& n : o.env) add(n);
  return names;
}

bool in_slurm() { return std::getenv("SLURM_JOB_ID") != nullptr; }

// The launcher command for one attempt: from the first restart on, --resume auto is added
// unless the program's arguments already say --resume.
std::vector<std::string> command(const Options& o, int restart) {
  const bool srun = o.launcher == "srun" || (o.launcher == "auto" && in_slurm());
  std::vector<std::string> cmd;
  const std::string n = std::to_string(o.nproc);
  if (srun) {
    cmd = {o.srun, "--ntasks", n, "--export=ALL"};
    if (o.bind != "none") cmd.push_back("--cpu-bind=" + std::string(o.bind == "numa" ? "ldoms" : "cores"));
    if (o.gpus_per_node > 0) {
      cmd.push_back("--gpus-per-node=" + std::to_string(o.gpus_per_node));
      cmd.push_back("--gpu-bind=closest");
    }
  } else {
    cmd = {o.mpirun, "-np", n};
    if (!o.hosts.empty()) cmd.insert(cmd.end(), {"--host", o.hosts});
    if (!o.hostfile.empty()) cmd.insert(cmd.end(), {"--hostfile", o.hostfile});
    if (o.bind == "none") {
      cmd.insert(cmd.end(), {"--bind-to", "none"});
    } else {
      cmd.insert(cmd.end(), {"--map-by", o.bind, "--bind-to", o.bind});
    }
    for (const auto& name : forwarded_names(o)) cmd.insert(cmd.end(), {"-x", name});
  }
  cmd.insert(cmd.end(), o.extra.begin(), o.extra.end());
  cmd.insert(cmd.end(), o.program.begin(), o.program.end());
  bool has_resume = false;
  for (const auto& a : o.program) has_resume = has_resume || a == "--resume" || a.rfind("--resume=", 0) == 0;
  if (restart > 0 && !has_resume) cmd.insert(cmd.end(), {"--resume", "auto"});
  return cmd;
}

std::string quoted(const std::vector<std::string>& cmd) {
  std::string s;
  for (const auto& a : cmd) {
    const bool plain = !a.empty() && a.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                                         "0123456789-_./:=,+@%") == std::string::npos;
    if (!s.empty()) s += ' ';
    if (plain) {
      s += a;
    } else {
      std::string q = "'";
      for (char c : a) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
      s += q + "'";
    }
  }
  return s;
}

volatile sig_atomic_t g_child = 0;
volatile sig_atomic_t g_signalled = 0;

void forward_signal(int sig) {
  g_signalled = sig;
  if (g_child > 0) ::kill(static_cast<pid_t>(g_child), sig);
}

// Runs cmd; returns its wait status (or -1 and errno
// text in `error` when it could not be started).
int run(const std::vector<std::string>& cmd, std::string& error) {
  int pipefd[2];
  if (::pipe2(pipefd, O_CLOEXEC) != 0) {  // closed by a successful exec
    error = std::strerror(errno);
    return -1;
  }
  const pid_t pid = ::fork();
  if (pid < 0) {
    error = std::strerror(errno);
    return -1;
  }
  if (pid == 0) {
    ::close(pipefd[0]);
    std::vector<char*> argv;
    for (const auto& a : cmd) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execvp(argv[0], argv.data());
    const int e = errno;
    (void)!::write(pipefd[1], &e, sizeof(e));
    ::_exit(127);
  }
  g_child = pid;
  ::close(pipefd[1]);
  int exec_errno = 0;
  ssize_t got = 0;
  while ((got = ::read(pipefd[0], &exec_errno, sizeof(exec_errno))) < 0 && errno == EINTR) {
  }
  const bool failed = got == sizeof(exec_errno);
  ::close(pipefd[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  g_child = 0;
  if (failed) {
    error = "cannot run '" + cmd.front() + "': " + std::strerror(exec_errno);
    return -1;
  }
  return status;
}

std::string describe(int status) {
  if (WIFEXITED(status)) return "exit code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("signal ") + strsignal(WTERMSIG(status));
  return "status " + std::to_string(status);
}

int exit_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return kExitFailure;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"dtrain-run: launch a dtrain program with mpirun or srun, with restarts from the latest checkpoint"};
  app.option_defaults()->always_capture_default();
  app.add_option("-n,--nproc", o.nproc, "ranks in all (0: the slots of --hosts, else 1)");
  app.add_option("--hosts", o.hosts, "hosts and slots, e.g. a:4,b:4 (mpirun --host)");
  app.add_option("--hostfile", o.hostfile, "an Open MPI hostfile")->excludes("--hosts");
  app.add_option("--launcher", o.launcher, "auto (srun inside a Slurm allocation, else mpirun), mpirun or srun")
      ->check(CLI::IsMember({"auto", "mpirun", "srun"}));
  app.add_option("--mpirun", o.mpirun, "the mpirun program");
  app.add_option("--srun", o.srun, "the srun program");
  app.add_option("--bind", o.bind, "bind each rank to its numa node, a core, or none")
      ->check(CLI::IsMember({"numa", "core", "none"}));
  app.add_option("--gpus-per-node", o.gpus_per_node, "srun: GPUs per node, each rank bound to its closest (mpirun: each rank uses GPU local_rank % GPUs)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-restarts", o.max_restarts, "relaunch a job that died up to K times (with --resume auto)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--dry-run", o.dry_run, "print the command and exit");
  app.add_option("--env", o.env, "another environment variable to forward (DTRAIN_* and NCCL_* always are)");
  app.add_option("--launcher-arg", o.extra, "an argument passed to mpirun/srun as it is (repeatable)")
      ->allow_extra_args(false);
  app.add_option("program", o.program, "the program and its arguments, after --")->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : kExitBadInput;
  }
  try {
    const int slots = o.hosts.empty() ? 0 : host_slots(o.hosts);
    if (o.nproc < 0) throw BadInput("-n " + std::to_string(o.nproc) + " is not allowed; allowed: >= 1");
    if (o.nproc == 0) o.nproc = slots > 0 ? slots : 1;
    if (slots > 0 && o.nproc > slots) {
      throw BadInput("-n " + std::to_string(o.nproc) + " exceeds the " + std::to_string(slots) + " slots of --hosts '" +
                     o.hosts + "'");
    }
    if (o.launcher == "srun" && (!o.hosts.empty() || !o.hostfile.empty())) {
      throw BadInput("--hosts / --hostfile are for mpirun; under srun the Slurm allocation decides the nodes");
    }
  } catch (const BadInput& e) {
    std::fprintf(stderr, "dtrain-run: error: %s\n", e.what());
    return kExitBadInput;
  }
  ::setenv("DTRAIN_RESTART_COUNT", "0", 1);  // forwarded like every DTRAIN_* variable
  if (o.dry_run) {
    std::printf("%s\n", quoted(command(o, 0)).c_str());
    return 0;
  }
  struct sigaction sa {};
  sa.sa_handler = forward_signal;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGTERM, SIGINT, SIGUSR1, SIGUSR2}) sigaction(sig, &sa, nullptr);
  int status = 0;
  for (int attempt = 0;; ++attempt) {
    ::setenv("DTRAIN_RESTART_COUNT", std::to_string(attempt).c_str(), 1);
    const auto cmd = command(o, attempt);
    std::fprintf(stderr, "dtrain-run: %s%s\n", attempt > 0 ? ("restart " + std::to_string(attempt) + ": ").c_str() : "",
                 quoted(cmd).c_str());
    std::string error;
    status = run(cmd, error);
    if (status < 0) {
      std::fprintf(stderr, "dtrain-run: error: %s\n", error.c_str());
      return kExitFailure;
    }
    const int code = exit_code(status);
    if (code == 0) return 0;
    if (g_signalled != 0) {
      std::fprintf(stderr, "dtrain-run: stopped by signal %s (job: %s); not restarting\n", strsignal(g_signalled),
                   describe(status).c_str());
      return code;
    }
    if (code == kExitPreempted) {
      std::fprintf(stderr, "dtrain-run: the job was preempted (saved, exit code 75); not restarting\n");
      return code;
    }
    if (attempt >= o.max_restarts) {
      if (o.max_restarts > 0) {
        std::fprintf(stderr, "dtrain-run: the job failed (%s) after %d restart(s); giving up\n",
                     describe(status).c_str(), o.max_restarts);
      }
      return code;
    }
    std::fprintf(stderr, "dtrain-run: the job died (%s); restarting from the latest good checkpoint (%d of %d)\n",
                 describe(status).c_str(), attempt + 1, o.max_restarts);
  }
}
