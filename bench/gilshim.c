/* gilshim: CPU time spent holding the GIL, counted per thread (LD_PRELOAD).
 *
 * Interposes PyEval_SaveThread (release) and PyEval_RestoreThread (acquire). Extension
 * modules (numpy, cv2, pipeline._jpeg, array_record's pybind11, ctypes) call them through
 * libpython's dynamic symbols, so a preloaded definition is found first. Per thread:
 * RestoreThread's return records CLOCK_THREAD_CPUTIME_ID; SaveThread's entry adds the
 * thread's CPU since then to a global held counter (nanoseconds, atomic). A thread whose
 * first call is SaveThread (it took the GIL inside the interpreter core, e.g. at thread
 * start) counts as holding it since it started: its CPU so far. At thread exit, a thread
 * our count sees holding the GIL adds its CPU since its last acquisition (a pthread key
 * destructor). pthread_create is interposed too, so that a thread libpython starts (a
 * `threading` thread: its start routine lies in libpython) is registered from its start
 * and a pure-Python thread that never calls an extension is counted when it ends; threads
 * that other libraries start (BLAS, OpenCV pools) are not Python threads and never count.
 *
 * Limitation: calls inside libpython itself are not interposed (time.sleep, lock waits,
 * file and socket I/O of the core, the eval loop's GIL switches). Their CPU counts as held:
 * it errs high, by the CPU of those core calls, which is small since a blocked wait burns
 * none. A thread's CPU since its last interposed acquisition is counted only at its next
 * interposed release (or exit): read the counters after the threads of interest made an
 * extension call (a ctypes CDLL call, as bench/gil.py's readers are, is one).
 *
 * Exported (ctypes): gilshim_held_ns(), gilshim_acquisitions(), gilshim_flush_self(),
 * gilshim_loaded(). Cheap: two clock reads and one atomic add per release/acquire pair.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef void *(*save_fn)(void);
typedef void (*restore_fn)(void *);

static save_fn real_save;
static restore_fn real_restore;
static atomic_ullong held_ns;
static atomic_ullong acquisitions;
static pthread_key_t exit_key;
static pthread_once_t key_once = PTHREAD_ONCE_INIT;

#define TLS static __thread __attribute__((tls_model("initial-exec")))
#define UNSEEN (-1)  /* no interposed call yet on this thread: held since it started */
#define RELEASED (-2)
TLS int64_t since = UNSEEN; /* thread CPU ns at the last acquisition, or UNSEEN/RELEASED */
TLS int registered;

static inline int64_t thread_cpu_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void add_held(int64_t now) {
  int64_t from = since == UNSEEN ? 0 : since;
  if (since != RELEASED && now > from) atomic_fetch_add_explicit(&held_ns, now - from, memory_order_relaxed);
}

static void on_exit_thread(void *unused) {
  (void)unused;
  add_held(thread_cpu_ns());
  since = RELEASED;
}

static void make_key(void) { pthread_key_create(&exit_key, on_exit_thread); }

static void register_thread(void) {
  registered = 1;
  pthread_once(&key_once, make_key);
  pthread_setspecific(exit_key, (void *)1);
}

static int lookup(void) {
  if (!real_save) real_save = (save_fn)dlsym(RTLD_NEXT, "PyEval_SaveThread");
  if (!real_restore) real_restore = (restore_fn)dlsym(RTLD_NEXT, "PyEval_RestoreThread");
  return real_save && real_restore;
}

static void resolve(void) {
  if (!lookup()) {
    fputs("gilshim: no PyEval_SaveThread/RestoreThread after the shim\n", stderr);
    abort();
  }
}

/* Threads libpython starts: registered at start, so their exit adds what they held. */
typedef int (*create_fn)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *);
static create_fn real_create;

struct start {
  void *(*routine)(void *);
  void *arg;
};

static void *python_thread(void *p) {
  struct start s = *(struct start *)p;
  free(p);
  register_thread();
  return s.routine(s.arg);
}

static int in_libpython(void *fn) {
  Dl_info a, b;
  if (!real_save && !lookup()) return 0; /* not a Python process (a child inheriting us) */
  return dladdr(fn, &a) && dladdr((void *)real_save, &b) && a.dli_fbase == b.dli_fbase;
}

int pthread_create(pthread_t *t, const pthread_attr_t *attr, void *(*routine)(void *), void *arg) {
  if (!real_create) real_create = (create_fn)dlsym(RTLD_NEXT, "pthread_create");
  struct start *s;
  if (!in_libpython((void *)routine) || !(s = malloc(sizeof *s))) return real_create(t, attr, routine, arg);
  s->routine = routine;
  s->arg = arg;
  int err = real_create(t, attr, python_thread, s);
  if (err) free(s);
  return err;
}

void *PyEval_SaveThread(void) {
  if (!real_save) resolve();
  if (!registered) register_thread();
  add_held(thread_cpu_ns());
  since = RELEASED;
  return real_save();
}

void PyEval_RestoreThread(void *tstate) {
  if (!real_restore) resolve();
  if (!registered) register_thread();
  real_restore(tstate);
  atomic_fetch_add_explicit(&acquisitions, 1, memory_order_relaxed);
  since = thread_cpu_ns();
}

unsigned long long gilshim_held_ns(void) { return atomic_load(&held_ns); }

unsigned long long gilshim_acquisitions(void) { return atomic_load(&acquisitions); }

/* Adds the calling thread's CPU since its last acquisition (call it holding the GIL, e.g.
 * through ctypes.PyDLL; through CDLL the call's own release already did). */
void gilshim_flush_self(void) {
  int64_t now = thread_cpu_ns();
  if (since == RELEASED) return;
  add_held(now);
  since = now;
}

int gilshim_loaded(void) { return 1; }
