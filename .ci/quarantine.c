/* A malloc that keeps freed blocks in quarantine and checks they stay untouched (issue 44).
 *
 * glibc notices a write into freed memory only when it lands on the allocator's own links
 * (``malloc(): unaligned tcache chunk detected``), and valgrind, which sees every write, runs a
 * process's threads one at a time, so a race between gloo's threads and the main thread can hide
 * from it. This library, preloaded into every process (``LD_PRELOAD``), runs at native speed
 * with the threads as they are: every block freed is filled with a pattern and held back; when
 * it leaves the quarantine, or when the process ends (``exit`` or ``_exit``), the pattern is
 * checked. A changed byte is a write after free: the report names the block's size, the changed
 * bytes and the stack that freed it. Every block also carries a guard after its end, checked on
 * free (a write past the end), and a second free of a block is reported where it happens.
 *
 * Settings (environment): QUARANTINE_MB (megabytes held back, 256), QUARANTINE_LOG (a file the
 * reports are appended to as well as stderr), QUARANTINE_NO_STACKS (no stack per free: about
 * twice as fast), QUARANTINE_FILL_NEW (a byte every new block starts as, e.g. 0xfe: a read of
 * memory nobody wrote then shows in the results), QUARANTINE_ABORT (abort at the first report),
 * QUARANTINE_VERBOSE (a summary line per process). A crash prints the native stack.
 *
 * glibc documents replacing malloc this way (malloc, free, calloc, realloc and the aligned
 * variants); the real allocator is reached through its exported ``__libc_*`` entry points.
 * Why by hand: AddressSanitizer checks only code built with it (torch's and gloo's libraries
 * are not), and no allocator in this machine's packages verifies a freed block's contents.
 *
 *     gcc -O2 -shared -fPIC -o quarantine.so .ci/quarantine.c -lpthread
 *     LD_PRELOAD=$PWD/quarantine.so python -m pytest tests/test_expert_combinations.py
 * (``make quarantine`` / ``.ci/quarantine.py`` build it and collect the reports.)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <execinfo.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

extern void *__libc_malloc(size_t);
extern void __libc_free(void *);
extern void *__libc_memalign(size_t, size_t);
extern void *__libc_realloc(void *, size_t);

#define MAGIC 0x51a4a17e9b3c5d0full
#define FREED 0xa5
#define GUARD 0xfd
#define GUARD_BYTES 32
#define FRAMES 14

typedef struct {  /* just before the user's bytes */
  void *base;     /* what the real allocator returned */
  size_t size;    /* the user's bytes */
  uint64_t magic; /* ours, and live (MAGIC) or freed (~MAGIC) */
  uint64_t pad;
} header_t;

typedef struct {
  char *user;
  size_t size;
  int frames;
  void *stack[FRAMES];
} entry_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static entry_t *ring;
static size_t ring_slots, ring_head, ring_count, held_bytes, limit_bytes;
static size_t checked, violations;
static int ready, do_abort, with_stacks;
static int fill_new = -1; /* QUARANTINE_FILL_NEW: a byte every new block starts as (malloc's) */
static __thread int inside; /* backtrace() may allocate: no quarantine work when nested */

static const char *log_path; /* QUARANTINE_LOG: reports also appended here (pytest captures fd 2) */

static void say_to(int fd, const char *text) {
  ssize_t ignored = write(fd, text, strlen(text));
  (void)ignored;
}

static void say(const char *text) {
  say_to(2, text);
  if (!log_path) return;
  int fd = open(log_path, O_WRONLY | O_APPEND | O_CREAT, 0644);
  if (fd < 0) return;
  say_to(fd, text);
  close(fd);
}

static void say_stack(void *const *stack, int frames) {
  backtrace_symbols_fd(stack, frames, 2);
  if (!log_path) return;
  int fd = open(log_path, O_WRONLY | O_APPEND | O_CREAT, 0644);
  if (fd < 0) return;
  backtrace_symbols_fd(stack, frames, fd);
  close(fd);
}

static header_t *header_of(void *user) { return (header_t *)user - 1; }

static void *allocate(size_t align, size_t size) {
  if (align < 16) align = 16;
  size_t front = align >= sizeof(header_t) ? align : sizeof(header_t);
  front = (front + align - 1) / align * align;
  char *base = align <= 16 ? __libc_malloc(front + size + GUARD_BYTES)
                           : __libc_memalign(align, front + size + GUARD_BYTES);
  if (!base) return NULL;
  char *user = base + front;
  header_t *h = header_of(user);
  h->base = base;
  h->size = size;
  h->magic = MAGIC;
  memset(user + size, GUARD, GUARD_BYTES);
  if (fill_new >= 0) memset(user, fill_new, size);
  return user;
}

static void report(const char *what, const entry_t *e, size_t first, size_t count) {
  char line[512];
  snprintf(line, sizeof line,
           "\n[quarantine pid %d] %s: block of %zu bytes at %p, %zu bytes changed, first at "
           "offset %zu:",
           (int)getpid(), what, e->size, (void *)e->user, count, first);
  say(line);
  const unsigned char *bytes = (const unsigned char *)e->user;
  size_t end = first + 48 < e->size + GUARD_BYTES ? first + 48 : e->size + GUARD_BYTES;
  for (size_t i = first; i < end; i++) {
    snprintf(line, sizeof line, " %02x", bytes[i]);
    say(line);
  }
  say("\n");
  if (e->frames) {
    say(strcmp(what, "write after free") == 0 ? "  freed at:\n" : "  freed (guard checked) at:\n");
    say_stack((void *const *)e->stack, e->frames);
  }
  violations++;
  if (do_abort) abort();
}

/* How many of ``n`` bytes differ from ``expected``; ``*first``: the first that does (or ``n``). */
static size_t count_changed(const unsigned char *bytes, size_t n, unsigned char expected,
                            size_t *first) {
  size_t count = 0;
  *first = n;
  for (size_t i = 0; i < n; i++)
    if (bytes[i] != expected) {
      if (!count) *first = i;
      count++;
    }
  return count;
}

static void verify_guard(const entry_t *e) {
  size_t first, count = count_changed((const unsigned char *)e->user + e->size, GUARD_BYTES,
                                      GUARD, &first);
  if (count) report("write past the end", e, e->size + first, count);
}

static void verify_and_release(entry_t *e) {
  size_t first, count = count_changed((const unsigned char *)e->user, e->size, FREED, &first);
  checked++;
  if (count) report("write after free", e, first, count);
  __libc_free(header_of(e->user)->base);
}

static void release(void *user) {
  header_t *h = header_of(user);
  entry_t e = {.user = user, .size = h->size, .frames = 0};
  if (with_stacks && !inside) {
    inside = 1;
    e.frames = backtrace(e.stack, FRAMES);
    inside = 0;
  }
  verify_guard(&e);
  h->magic = ~MAGIC;
  if (!ready || inside || e.size > limit_bytes / 4) {
    __libc_free(h->base);
    return;
  }
  memset(user, FREED, e.size);
  entry_t out[9]; /* up to eight evicted, and this one when they did not make room */
  int n_out = 0;
  pthread_mutex_lock(&lock);
  while ((ring_count == ring_slots || held_bytes + e.size > limit_bytes) && n_out < 8) {
    size_t tail = (ring_head + ring_slots - ring_count) % ring_slots;
    out[n_out++] = ring[tail];
    held_bytes -= ring[tail].size;
    ring_count--;
  }
  if (ring_count < ring_slots && held_bytes + e.size <= limit_bytes) {
    ring[ring_head] = e;
    ring_head = (ring_head + 1) % ring_slots;
    ring_count++;
    held_bytes += e.size;
  } else {
    out[n_out++] = e; /* still full after eight evictions: checked and freed at once */
  }
  pthread_mutex_unlock(&lock);
  for (int i = 0; i < n_out; i++) verify_and_release(&out[i]);
}

static int ours(void *user) {
  return user && header_of(user)->magic == MAGIC;
}

void *malloc(size_t size) { return allocate(16, size); }

void free(void *user) {
  if (!user) return;
  if (ours(user)) release(user);
  else if (header_of(user)->magic == ~MAGIC) {
    char line[120];
    snprintf(line, sizeof line, "\n[quarantine pid %d] free of a block already freed, here:\n",
             (int)getpid());
    say(line);
    void *stack[FRAMES];
    say_stack(stack, backtrace(stack, FRAMES));
    violations++;
    if (do_abort) abort();
  } else __libc_free(user); /* allocated before this library was loaded */
}

void *calloc(size_t n, size_t size) {
  if (size && n > SIZE_MAX / size) {
    errno = ENOMEM;
    return NULL;
  }
  void *user = allocate(16, n * size);
  if (user) memset(user, 0, n * size);
  return user;
}

/* As glibc's: in place where it can (code that keeps using the old pointer after a realloc that
 * happened not to move is another defect, and not the one this library looks for). */
void *realloc(void *old, size_t size) {
  if (!old) return malloc(size);
  if (!size) {
    free(old);
    return NULL;
  }
  if (!ours(old)) { /* allocated before this library was loaded: its size is unknown */
    void *user = allocate(16, size);
    if (user) memcpy(user, old, size);
    return user;
  }
  header_t *h = header_of(old);
  char *base = h->base;
  size_t front = (char *)old - base;
  if (front != sizeof(header_t)) { /* an aligned block: realloc keeps no alignment */
    void *user = allocate(16, size);
    if (!user) return NULL;
    memcpy(user, old, h->size < size ? h->size : size);
    free(old);
    return user;
  }
  char *moved = __libc_realloc(base, front + size + GUARD_BYTES);
  if (!moved) return NULL;
  char *user = moved + front;
  h = header_of(user);
  h->base = moved;
  h->size = size;
  memset(user + size, GUARD, GUARD_BYTES);
  return user;
}

int posix_memalign(void **out, size_t align, size_t size) {
  if (align % sizeof(void *) || (align & (align - 1))) return EINVAL;
  void *user = allocate(align, size);
  if (!user) return ENOMEM;
  *out = user;
  return 0;
}

void *memalign(size_t align, size_t size) { return allocate(align, size); }
void *aligned_alloc(size_t align, size_t size) { return allocate(align, size); }
void *valloc(size_t size) { return allocate((size_t)sysconf(_SC_PAGESIZE), size); }

void *pvalloc(size_t size) {
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  return allocate(page, (size + page - 1) / page * page);
}

size_t malloc_usable_size(void *user) { return ours(user) ? header_of(user)->size : 0; }

static void before_fork(void) { pthread_mutex_lock(&lock); }
static void after_fork(void) { pthread_mutex_unlock(&lock); }

static void drain(void) {
  pthread_mutex_lock(&lock);
  while (ring_count) {
    size_t tail = (ring_head + ring_slots - ring_count) % ring_slots;
    entry_t e = ring[tail];
    held_bytes -= e.size;
    ring_count--;
    pthread_mutex_unlock(&lock);
    verify_and_release(&e);
    pthread_mutex_lock(&lock);
  }
  pthread_mutex_unlock(&lock);
  char line[160];
  snprintf(line, sizeof line, "[quarantine pid %d] %zu freed blocks checked, %zu violations\n",
           (int)getpid(), checked, violations);
  if (getenv("QUARANTINE_VERBOSE") || violations) say(line);
}

/* ``os._exit`` (multiprocessing's children, a rank's hard stop) skips atexit: check there too */
void _exit(int status) {
  drain();
  syscall(SYS_exit_group, status);
  __builtin_unreachable();
}

void _Exit(int status) { _exit(status); }

/* A crash under quarantine is often a read of a freed block (a pointer read as 0xa5a5...): say
 * where, with the native stack, then die of the signal as before. */
static void crashed(int sig, siginfo_t *info, void *context) {
  (void)context;
  char line[160];
  snprintf(line, sizeof line, "\n[quarantine pid %d] signal %d at address %p; native stack:\n",
           (int)getpid(), sig, info->si_addr);
  say(line);
  void *stack[40];
  say_stack(stack, backtrace(stack, 40));
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void start(void) {
  const char *mb = getenv("QUARANTINE_MB");
  limit_bytes = (size_t)(mb ? atol(mb) : 256) << 20;
  do_abort = getenv("QUARANTINE_ABORT") != NULL;
  log_path = getenv("QUARANTINE_LOG");
  const char *fill = getenv("QUARANTINE_FILL_NEW");
  fill_new = fill ? (int)(strtol(fill, NULL, 0) & 0xff) : -1;
  with_stacks = getenv("QUARANTINE_NO_STACKS") == NULL;
  ring_slots = 1 << 18;
  ring = __libc_malloc(ring_slots * sizeof(entry_t));
  void *warm[2];
  inside = 1;
  backtrace(warm, 2); /* loads the unwinder now, not inside a free */
  inside = 0;
  pthread_atfork(before_fork, after_fork, after_fork);
  atexit(drain);
  struct sigaction action = {.sa_sigaction = crashed, .sa_flags = SA_SIGINFO | SA_RESETHAND};
  sigaction(SIGSEGV, &action, NULL);
  sigaction(SIGBUS, &action, NULL);
  ready = ring != NULL;
}
