/*
 * STAND-IN for libflagcx's P2P engine C ABI, for tests only.
 *
 * FlagCX's real engine needs an accelerator runtime and an RDMA NIC, which this machine
 * does not have. This small library exports the same flagcxP2pRpc* symbols with the same
 * signatures and semantics, so the project's REAL ctypes binding runs across two processes:
 * an engine listens on a loopback TCP port, a peer connecting receives the registered
 * region table (and the pid), and BatchWriteSync writes by absolute address into the peer
 * process (process_vm_writev), refusing destinations outside the peer's regions.
 *
 * It answers like the real facade (flagcx/include/flagcx_p2p.h, v0.13.0 .. main): every
 * failure returns -1, flagcxGetErrorString says "Not implemented." for every code, and
 * flagcxGetVersion reports 10000 ("1.0.0", as every release does).
 *
 * Build knobs: -DSTANDIN_VERSION=N (what flagcxGetVersion reports), -DOMIT_BATCH_WRITE
 * (a library missing a required symbol), -DOMIT_REGISTER_HOST (flagcxP2pRpcRegisterHost
 * absent, as in every release so far). Fault knobs (environment of the calling process):
 * FLAGCX_STANDIN_GETCONN_DELAY=S sleeps S seconds in GetConn (a dead peer blocks ~25 s),
 * FLAGCX_STANDIN_FAIL_WRITE_FROM=N fails the N-th write on, FLAGCX_STANDIN_REFUSE_REGISTER=1,
 * FLAGCX_STANDIN_SILENT_SKIP=1 returns success without copying (what the real engine does
 * when RDMA slices fail).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#ifndef STANDIN_VERSION
#define STANDIN_VERSION 10000
#endif
#define MAX_REGIONS 4096

typedef struct { uint64_t addr, size; } region_t;
typedef struct {
  int listen_fd, port, nregions, running;
  pthread_t thread;
  region_t regions[MAX_REGIONS];
} engine_t;
typedef struct { int32_t pid, nregions; region_t regions[MAX_REGIONS]; } conn_t;

static int writes_done = 0;

int flagcxGetVersion(int *version) { *version = STANDIN_VERSION; return 0; }

const char *flagcxGetErrorString(int result) {
  (void)result;
  return "Not implemented.";
}

void *flagcxP2pRpcEngineCreate(void) {
  engine_t *e = calloc(1, sizeof(engine_t));
  struct sockaddr_in a = {0};
  socklen_t len = sizeof(a);
  e->listen_fd = socket(AF_INET, SOCK_STREAM, 0);
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (bind(e->listen_fd, (struct sockaddr *)&a, sizeof(a)) || listen(e->listen_fd, 16) ||
      getsockname(e->listen_fd, (struct sockaddr *)&a, &len)) {
    close(e->listen_fd); free(e); return NULL;
  }
  e->port = ntohs(a.sin_port);
  return e;
}

static void *serve(void *arg) {
  engine_t *e = arg;
  while (e->running) {
    int fd = accept(e->listen_fd, NULL, NULL);
    if (fd < 0) break;
    int32_t header[2] = {getpid(), e->nregions};
    if (write(fd, header, sizeof(header)) == sizeof(header))
      (void)!write(fd, e->regions, sizeof(region_t) * e->nregions);
    close(fd);
  }
  return NULL;
}

int flagcxP2pRpcStartServer(void *engine) {
  engine_t *e = engine;
  if (e->running) return 0;
  e->running = 1;
  return pthread_create(&e->thread, NULL, serve, e) ? -1 : 0;
}

void flagcxP2pRpcEngineDestroy(void *engine) {
  engine_t *e = engine;
  e->running = 0;
  shutdown(e->listen_fd, SHUT_RDWR);
  close(e->listen_fd);
  free(e);
}

int flagcxP2pRpcGetPort(void *engine) { return ((engine_t *)engine)->port; }

int flagcxP2pRpcRegister(void *engine, uint64_t addr, uint64_t size, uint64_t *mr_id) {
  engine_t *e = engine;
  if (getenv("FLAGCX_STANDIN_REFUSE_REGISTER") || e->nregions >= MAX_REGIONS) return -1;
  e->regions[e->nregions].addr = addr;
  e->regions[e->nregions].size = size;
  *mr_id = (uint64_t)e->nregions++;
  return 0;
}

#ifndef OMIT_REGISTER_HOST
int host_registrations = 0;  /* read by the tests through ctypes */
int flagcxP2pRpcRegisterHost(void *engine, uint64_t addr, uint64_t size, uint64_t *mr_id) {
  host_registrations++;
  return flagcxP2pRpcRegister(engine, addr, size, mr_id);
}
#endif

static int read_all(int fd, void *buf, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = read(fd, (char *)buf + got, n - got);
    if (r <= 0) return -1;
    got += (size_t)r;
  }
  return 0;
}

void *flagcxP2pRpcGetConn(void *engine, const char *host_port) {
  (void)engine;
  const char *delay = getenv("FLAGCX_STANDIN_GETCONN_DELAY");
  if (delay) sleep((unsigned)atoi(delay));
  char host[256];
  int port = 0;
  if (sscanf(host_port, "%255[^:]:%d", host, &port) != 2) return NULL;
  struct sockaddr_in a = {0};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  if (inet_pton(AF_INET, host, &a.sin_addr) != 1) return NULL;
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  conn_t *c = calloc(1, sizeof(conn_t));
  int32_t header[2];
  if (connect(fd, (struct sockaddr *)&a, sizeof(a)) || read_all(fd, header, sizeof(header)) ||
      header[1] > MAX_REGIONS || read_all(fd, c->regions, sizeof(region_t) * header[1])) {
    close(fd); free(c); return NULL;
  }
  close(fd);
  c->pid = header[0];
  c->nregions = header[1];
  return c;
}

#ifndef OMIT_BATCH_WRITE
int flagcxP2pRpcBatchWriteSync(void *conn, int n, const uint64_t *src, const uint64_t *dst,
                               const uint64_t *sizes) {
  conn_t *c = conn;
  const char *fail_from = getenv("FLAGCX_STANDIN_FAIL_WRITE_FROM");
  if (fail_from && writes_done++ >= atoi(fail_from)) return -1;
  for (int i = 0; i < n; i++) {
    int inside = 0;
    for (int r = 0; r < c->nregions && !inside; r++)
      inside = dst[i] >= c->regions[r].addr &&
               dst[i] + sizes[i] <= c->regions[r].addr + c->regions[r].size;
    if (!inside) return -1;
  }
  if (getenv("FLAGCX_STANDIN_SILENT_SKIP")) return 0;
  for (int start = 0; start < n; start += 1024) {
    int m = n - start < 1024 ? n - start : 1024;
    struct iovec local[1024], remote[1024];
    ssize_t want = 0;
    for (int i = 0; i < m; i++) {
      local[i].iov_base = (void *)src[start + i];
      remote[i].iov_base = (void *)dst[start + i];
      local[i].iov_len = remote[i].iov_len = sizes[start + i];
      want += (ssize_t)sizes[start + i];
    }
    if (process_vm_writev(c->pid, local, m, remote, m, 0) != want) return -1;
  }
  return 0;
}
#endif
