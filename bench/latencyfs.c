/* latencyfs: a read-only FUSE passthrough of a directory where every read waits.

   latencyfs SOURCE MOUNTPOINT -f -o latency_ms=20 [-o threads=1024]
             [-o requests_per_s=250] [-o mb_per_s=100] [-o attr_timeout_s=60]

   Stands in for object storage (a GCS bucket through gcsfuse): every read request of a
   file is answered no sooner than `latency_ms` after it arrived, and never from the page
   cache (files are opened with direct_io, so there is no readahead either and every epoch
   pays the latency again). Requests are served on many threads, so concurrent reads wait
   concurrently: up to `threads` (default 1024; libfuse's own default is 10).

   A bucket also rations requests and a host's link bytes: with `requests_per_s` a request
   starts no sooner than 1/requests_per_s after the one before it started (a token bucket
   holding one token: requests over the cap queue, as a client that backs off waits), and
   with `mb_per_s` the requests' bytes leave one after another at that rate, after the
   latency. Both default to 0: no cap. The kernel keeps names and attributes `attr_timeout_s`
   (default 60: metadata is not what we measure; 0: every stat asks us, as gcsfuse without its
   stat cache).

   Two virtual files at the root, absent from listings, report the counters as one line of
   JSON (reads, bytes, reads in flight now and at most, opens, reads that waited for the
   request cap (capped) and for the bandwidth cap (slowed); data files only):
     /.rig-stats   a snapshot
     /.rig-reset   a snapshot, then every counter back to zero (max_in_flight: to in_flight)
   Two more stand in for a mount that stops answering (gcsfuse on a dead connection):
     /.rig-stall   a snapshot, then every read and open of a data file waits (blocked in its
                   syscall; one the kernel interrupts, as when its process exits, ends with
                   EINTR, as gcsfuse cancels it). Not lookups: one stalled would hold every
                   lookup in its folder, /.rig-resume's too.
     /.rig-stall-stats  as /.rig-stall, and so do the attribute requests of data files (a stat
                   or lookup the kernel's cache does not answer): for a process that ends
                   before /.rig-resume is read (its stalled lookup interrupted). Not the root's:
                   every path's walk asks for them (default_permissions).
     /.rig-resume  a snapshot, then the waiting reads go on

   Built and mounted by bench/rig.py; `python -m bench.rig --help` runs it by hand. */

#define FUSE_USE_VERSION 35
#define _GNU_SOURCE

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <fuse.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define STATS_PATH "/.rig-stats"
#define RESET_PATH "/.rig-reset"
#define STALL_PATH "/.rig-stall"
#define RESUME_PATH "/.rig-resume"
#define STALL_STATS_PATH "/.rig-stall-stats"

static struct {
  char *source;      /* absolute path of the source directory */
  char *latency_ms;  /* as given; parsed into latency_ns */
  char *requests_per_s; /* as given; parsed into gap_ns */
  char *mb_per_s;    /* as given; parsed into ns_per_byte */
  char *attr_timeout_s; /* as given; parsed into attr_s */
  unsigned threads;  /* libfuse's max_threads and max_idle_threads */
  int64_t latency_ns;
  int64_t gap_ns;    /* between two requests' starts; 0: no request cap */
  double ns_per_byte; /* 0: no bandwidth cap */
  double attr_s;     /* how long the kernel keeps names and attributes */
} config;

static atomic_llong reads, bytes_read, opens, in_flight, max_in_flight, capped, slowed;
static pthread_mutex_t caps = PTHREAD_MUTEX_INITIALIZER;
static int64_t next_start_ns, next_byte_ns; /* under `caps` */
static atomic_int stalled; /* 0: answering; 1: reads and opens wait; 2: stats too */

struct handle {
  int fd;      /* the source file, or -1 for a virtual file */
  char *text;  /* a virtual file's contents */
  size_t size;
};

static char *source_path(const char *path) {
  char *full = NULL;
  if (asprintf(&full, "%s%s", config.source, path) < 0) return NULL;
  return full;
}

static int is_virtual(const char *path) {
  return strcmp(path, STATS_PATH) == 0 || strcmp(path, RESET_PATH) == 0 ||
         strcmp(path, STALL_PATH) == 0 || strcmp(path, RESUME_PATH) == 0 ||
         strcmp(path, STALL_STATS_PATH) == 0;
}

/* Polls, holding no lock: libfuse cancels its workers at exit, stalled ones included. A
   request the kernel interrupts (its process got a fatal signal, or is exiting) ends with
   EINTR, as gcsfuse cancels an interrupted request: returns -EINTR then, else 0. */
static int wait_while_stalled(void) {
  struct timespec tick = {.tv_sec = 0, .tv_nsec = 10000000};
  while (atomic_load(&stalled)) {
    if (fuse_interrupted()) return -EINTR;
    nanosleep(&tick, NULL);
  }
  return 0;
}

static char *snapshot(int reset) {
  long long r, b, o, now, peak, c, w;
  if (reset) {
    r = atomic_exchange(&reads, 0);
    b = atomic_exchange(&bytes_read, 0);
    o = atomic_exchange(&opens, 0);
    c = atomic_exchange(&capped, 0);
    w = atomic_exchange(&slowed, 0);
    now = atomic_load(&in_flight);
    peak = atomic_exchange(&max_in_flight, now);
  } else {
    r = atomic_load(&reads);
    b = atomic_load(&bytes_read);
    o = atomic_load(&opens);
    c = atomic_load(&capped);
    w = atomic_load(&slowed);
    now = atomic_load(&in_flight);
    peak = atomic_load(&max_in_flight);
  }
  char *text = NULL;
  if (asprintf(&text,
               "{\"reads\": %lld, \"bytes\": %lld, \"in_flight\": %lld, "
               "\"max_in_flight\": %lld, \"opens\": %lld, \"capped\": %lld, "
               "\"slowed\": %lld, \"latency_ms\": %.6g, \"requests_per_s\": %.6g, "
               "\"mb_per_s\": %.6g}\n",
               r, b, now, peak, o, c, w, config.latency_ns / 1e6,
               config.gap_ns ? 1e9 / config.gap_ns : 0.0,
               config.ns_per_byte ? 1e3 / config.ns_per_byte : 0.0) < 0)
    return NULL;
  return text;
}

static void *rig_init(struct fuse_conn_info *conn, struct fuse_config *cfg) {
  (void)conn;
  cfg->use_ino = 1;
  cfg->direct_io = 1;   /* no page cache, no readahead: every read reaches us */
  cfg->kernel_cache = 0;
  cfg->entry_timeout = cfg->attr_timeout = config.attr_s;
  return NULL;
}

static int rig_getattr(const char *path, struct stat *st, struct fuse_file_info *fi) {
  (void)fi;
  if (is_virtual(path)) {
    memset(st, 0, sizeof *st);
    st->st_mode = S_IFREG | 0444;
    st->st_nlink = 1;
    st->st_size = 0; /* direct_io: reads are not cut at the size */
    return 0;
  }
  if (atomic_load(&stalled) == 2 && strcmp(path, "/") != 0) {
    int stop = wait_while_stalled();
    if (stop) return stop;
  }
  char *full = source_path(path);
  if (!full) return -ENOMEM;
  int res = lstat(full, st);
  int err = errno;
  free(full);
  if (res) return -err;
  st->st_mode &= ~(S_IWUSR | S_IWGRP | S_IWOTH);
  return 0;
}

static int rig_readdir(const char *path, void *buf, fuse_fill_dir_t fill, off_t offset,
                       struct fuse_file_info *fi, enum fuse_readdir_flags flags) {
  (void)offset, (void)fi, (void)flags;
  char *full = source_path(path);
  if (!full) return -ENOMEM;
  DIR *dir = opendir(full);
  int err = errno;
  free(full);
  if (!dir) return -err;
  struct dirent *entry;
  while ((entry = readdir(dir))) {
    struct stat st = {.st_ino = entry->d_ino, .st_mode = (mode_t)DTTOIF(entry->d_type)};
    if (fill(buf, entry->d_name, &st, 0, 0)) break;
  }
  closedir(dir);
  return 0;
}

static int rig_open(const char *path, struct fuse_file_info *fi) {
  if ((fi->flags & O_ACCMODE) != O_RDONLY) return -EROFS;
  struct handle *h = calloc(1, sizeof *h);
  if (!h) return -ENOMEM;
  h->fd = -1;
  if (is_virtual(path)) {
    h->text = snapshot(strcmp(path, RESET_PATH) == 0);
    if (strcmp(path, STALL_PATH) == 0 || strcmp(path, RESUME_PATH) == 0)
      atomic_store(&stalled, strcmp(path, STALL_PATH) == 0);
    if (strcmp(path, STALL_STATS_PATH) == 0) atomic_store(&stalled, 2);
    if (!h->text) {
      free(h);
      return -ENOMEM;
    }
    h->size = strlen(h->text);
  } else {
    int stop = wait_while_stalled();
    char *full = stop ? NULL : source_path(path);
    if (!full) {
      free(h);
      return stop ? stop : -ENOMEM;
    }
    h->fd = open(full, O_RDONLY);
    int err = errno;
    free(full);
    if (h->fd < 0) {
      free(h);
      return -err;
    }
    atomic_fetch_add(&opens, 1);
  }
  fi->fh = (uint64_t)(uintptr_t)h;
  fi->direct_io = 1;
  fi->keep_cache = 0;
  return 0;
}

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* When a request that arrived at `arrival` may start: the request cap's next free slot. */
static int64_t admit(int64_t arrival) {
  if (!config.gap_ns) return arrival;
  pthread_mutex_lock(&caps);
  int64_t start = arrival;
  if (next_start_ns > start) {
    start = next_start_ns;
    atomic_fetch_add(&capped, 1);
  }
  next_start_ns = start + config.gap_ns;
  pthread_mutex_unlock(&caps);
  return start;
}

/* When `n` bytes whose first byte is ready at `ready` have all left: the bandwidth cap. */
static int64_t transfer(int64_t ready, ssize_t n) {
  if (config.ns_per_byte <= 0 || n <= 0) return ready;
  pthread_mutex_lock(&caps);
  int64_t begin = ready;
  if (next_byte_ns > begin) {
    begin = next_byte_ns;
    atomic_fetch_add(&slowed, 1);
  }
  next_byte_ns = begin + (int64_t)(n * config.ns_per_byte);
  int64_t end = next_byte_ns;
  pthread_mutex_unlock(&caps);
  return end;
}

static int rig_read(const char *path, char *buf, size_t size, off_t offset,
                    struct fuse_file_info *fi) {
  (void)path;
  struct handle *h = (struct handle *)(uintptr_t)fi->fh;
  if (h->fd < 0) { /* a virtual file: no latency, not counted */
    if ((size_t)offset >= h->size) return 0;
    size_t n = h->size - (size_t)offset < size ? h->size - (size_t)offset : size;
    memcpy(buf, h->text + offset, n);
    return (int)n;
  }
  int stop = wait_while_stalled();
  if (stop) return stop;
  int64_t start = admit(now_ns());
  long long now = atomic_fetch_add(&in_flight, 1) + 1;
  long long peak = atomic_load(&max_in_flight);
  while (now > peak && !atomic_compare_exchange_weak(&max_in_flight, &peak, now)) {
  }
  ssize_t n = pread(h->fd, buf, size, offset);
  int err = errno;
  int64_t done = transfer(start + config.latency_ns, n);
  struct timespec deadline = {.tv_sec = done / 1000000000, .tv_nsec = done % 1000000000};
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &deadline, NULL) == EINTR) {
  }
  atomic_fetch_add(&reads, 1);
  if (n > 0) atomic_fetch_add(&bytes_read, n);
  atomic_fetch_sub(&in_flight, 1);
  return n < 0 ? -err : (int)n;
}

static int rig_release(const char *path, struct fuse_file_info *fi) {
  (void)path;
  struct handle *h = (struct handle *)(uintptr_t)fi->fh;
  if (h->fd >= 0) close(h->fd);
  free(h->text);
  free(h);
  return 0;
}

static const struct fuse_operations rig_ops = {
  .init = rig_init,
  .getattr = rig_getattr,
  .readdir = rig_readdir,
  .open = rig_open,
  .read = rig_read,
  .release = rig_release,
};

static const struct fuse_opt rig_opts[] = {
  {"latency_ms=%s", offsetof(typeof(config), latency_ms), 0},
  {"threads=%u", offsetof(typeof(config), threads), 0},
  {"requests_per_s=%s", offsetof(typeof(config), requests_per_s), 0},
  {"mb_per_s=%s", offsetof(typeof(config), mb_per_s), 0},
  {"attr_timeout_s=%s", offsetof(typeof(config), attr_timeout_s), 0},
  FUSE_OPT_END,
};

static int keep_source(void *data, const char *arg, int key, struct fuse_args *args) {
  (void)data, (void)args;
  if (key == FUSE_OPT_KEY_NONOPT && !config.source) {
    config.source = realpath(arg, NULL);
    if (!config.source) {
      fprintf(stderr, "latencyfs: source %s: %s\n", arg, strerror(errno));
      exit(2);
    }
    return 0; /* consumed: the rest (the mountpoint) goes to fuse_main */
  }
  return 1;
}

int main(int argc, char *argv[]) {
  /* In the foreground, unmount (SIGTERM) when the process that started us dies, so a crashed
     benchmark leaves no mount behind; a daemonized copy (no -f) forks and loses this. */
  pid_t parent = getppid();
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (getppid() != parent) return 1; /* it died before we asked */
  struct fuse_args args = FUSE_ARGS_INIT(argc, argv);
  config.threads = 1024;
  if (fuse_opt_parse(&args, &config, rig_opts, keep_source) == -1) return 2;
  if (!config.source) {
    fprintf(stderr, "usage: latencyfs SOURCE MOUNTPOINT -f -o latency_ms=MS [fuse options]\n");
    return 2;
  }
  double ms = config.latency_ms ? strtod(config.latency_ms, NULL) : 0.0;
  if (ms < 0 || ms > 1e6) {
    fprintf(stderr, "latencyfs: latency_ms must be in [0, 1e6], got %s\n", config.latency_ms);
    return 2;
  }
  config.latency_ns = (int64_t)(ms * 1e6);
  double rate = config.requests_per_s ? strtod(config.requests_per_s, NULL) : 0.0;
  double mb = config.mb_per_s ? strtod(config.mb_per_s, NULL) : 0.0;
  if (rate < 0 || rate > 1e9 || mb < 0 || mb > 1e9) {
    fprintf(stderr, "latencyfs: requests_per_s and mb_per_s must be in [0, 1e9]\n");
    return 2;
  }
  config.attr_s = config.attr_timeout_s ? strtod(config.attr_timeout_s, NULL) : 60.0;
  if (config.attr_s < 0 || config.attr_s > 1e6) {
    fprintf(stderr, "latencyfs: attr_timeout_s must be in [0, 1e6], got %s\n",
            config.attr_timeout_s);
    return 2;
  }
  config.gap_ns = rate > 0 ? (int64_t)(1e9 / rate) : 0;
  config.ns_per_byte = mb > 0 ? 1e3 / mb : 0.0;
  if (config.threads < 1 || config.threads > 100000) {
    fprintf(stderr, "latencyfs: threads must be in [1, 100000], got %u\n", config.threads);
    return 2;
  }
  char threads[80]; /* idle threads are kept: creating one costs more than keeping it */
  snprintf(threads, sizeof threads, "-omax_threads=%u,max_idle_threads=%u", config.threads,
           config.threads);
  fuse_opt_add_arg(&args, threads);
  fuse_opt_add_arg(&args, "-oro,default_permissions,fsname=latencyfs,subtype=latencyfs");
  int res = fuse_main(args.argc, args.argv, &rig_ops, NULL);
  fuse_opt_free_args(&args);
  return res;
}
