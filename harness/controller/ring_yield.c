/* Preloaded into ring ranks that fill this machine's cores (harness/controller/ring_yield.py).
 *
 * MLX's ring polls its non-blocking sockets in a loop while a transfer waits on a peer. When the
 * ranks fill the cores, that loop holds a core the awaited peer or the controller needs. Here a poll that
 * finds nothing to read or no room to write gives its core away before it returns, unchanged, to MLX:
 * for the first SPIN_NS of a thread's wait it yields (sched_yield, which returns at once where nothing
 * else is runnable), and after that it sleeps an eighth of the time waited so far, at most MAX_NAP_NS,
 * so a long wait stops costing CPU and a wait is lengthened by at most an eighth. Every byte and every
 * error is MLX's own.
 *
 * MLX_DDP_HARNESS_RING_YIELD_ACTIVE=0 in the environment switches it off (every call passes straight
 * through): a warm-start server preloads it for every rank it forks (a fork cannot add a preload), and
 * each rank's environment says whether it yields. Read at each wait, so a rank forked from a server
 * follows its own environment. Unset, it is on: a preload is a request to yield. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>

#define SPIN_NS 50000LL     /* yield only, for the first 50 us of a wait */
#define MAX_NAP_NS 200000LL /* the longest sleep: 200 us */

static ssize_t (*next_recv)(int, void *, size_t, int);
static ssize_t (*next_send)(int, const void *, size_t, int);

static __thread long long waiting_since; /* ns; 0: the last poll moved bytes */

static long long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static int switched_off(void) {
  const char *v = getenv("MLX_DDP_HARNESS_RING_YIELD_ACTIVE");
  return v && v[0] == '0' && v[1] == 0;
}

static void yield_if_waiting(ssize_t r) {
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
    int saved = errno;
    if (switched_off()) return;
    long long now = now_ns();
    if (!waiting_since) waiting_since = now;
    long long waited = now - waiting_since;
    if (waited < SPIN_NS) {
      sched_yield();
    } else {
      long long nap = waited / 8 > MAX_NAP_NS ? MAX_NAP_NS : waited / 8;
      struct timespec t = {0, (long)nap};
      nanosleep(&t, 0);
    }
    errno = saved;
  } else if (r >= 0) {
    waiting_since = 0;
  }
}

ssize_t recv(int fd, void *buf, size_t n, int flags) {
  if (!next_recv) next_recv = (ssize_t (*)(int, void *, size_t, int))dlsym(RTLD_NEXT, "recv");
  ssize_t r = next_recv(fd, buf, n, flags);
  yield_if_waiting(r);
  return r;
}

ssize_t send(int fd, const void *buf, size_t n, int flags) {
  if (!next_send) next_send = (ssize_t (*)(int, const void *, size_t, int))dlsym(RTLD_NEXT, "send");
  ssize_t r = next_send(fd, buf, n, flags);
  yield_if_waiting(r);
  return r;
}
