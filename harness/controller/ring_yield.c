/* Preloaded into ring ranks that fill this machine's cores (harness/controller/ring_yield.py).
 *
 * MLX's ring polls its non-blocking sockets in a loop while a transfer waits on a peer. When the
 * ranks fill the cores, that loop holds a core the awaited peer or the controller needs. Here a poll that
 * finds nothing to read or no room to write gives its core away (sched_yield) before it returns,
 * unchanged, to MLX. Every byte and every error is MLX's own. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/types.h>

static ssize_t (*next_recv)(int, void *, size_t, int);
static ssize_t (*next_send)(int, const void *, size_t, int);

static void yield_if_waiting(ssize_t r) {
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
    int saved = errno;
    sched_yield();
    errno = saved;
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
