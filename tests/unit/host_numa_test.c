/*
 * Host memory near a device (kernels/host_numa.c): the node sysfs gives a PCIe function, read for
 * this host's own functions and for one that does not exist; and a thread's preference for a node,
 * inherited by the threads it starts and followed by the pages it touches, refused for nodes out of
 * range, with the variable set, or over a policy the thread already has. Each case runs on a
 * thread of its own, since a memory policy belongs to a thread.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../support/mempolicy_probe.h"
#include "host_numa.h"

#define REGION ((size_t)4 << 20)

typedef struct {
  int node;        /* asked for */
  int preset;      /* the thread binds itself to node `node` first, as numactl would */
  int preset_rc;   /* bind_node's answer */
  int got;         /* dsv4_host_prefer_node's answer */
  policy_t after;  /* the thread's policy after it */
  policy_t child;  /* a thread started after it */
  int mapped;      /* the region below could be mapped */
  int first, last; /* nodes of the first and last pages of a region touched after it (kernel) */
  int lib_first, lib_last, lib_gone; /* dsv4_page_numa_node of those, and after the unmap */
} case_t;

static void *read_policy(void *out) {
  *(policy_t *)out = policy_now();
  return NULL;
}

/* The case's thread: it only records; the test's thread asserts (cmocka's failures jump). */
static void *run_case(void *arg) {
  case_t *k = arg;
  if (k->preset)
    k->preset_rc = bind_node(k->node);
  k->got = dsv4_host_prefer_node(k->node, "DSV4_TEST_NUMA_OFF");
  k->after = policy_now();
  pthread_t t;
  if (pthread_create(&t, NULL, read_policy, &k->child) == 0)
    pthread_join(t, NULL);
  else
    k->child.mode = -2;
  uint8_t *r = mmap(NULL, REGION, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  k->mapped = r != MAP_FAILED;
  if (!k->mapped)
    return NULL;
  memset(r, 1, REGION);
  k->first = page_node(r);
  k->last = page_node(r + REGION - 1);
  k->lib_first = dsv4_page_numa_node(r);
  k->lib_last = dsv4_page_numa_node(r + REGION - 1);
  munmap(r, REGION);
  k->lib_gone = dsv4_page_numa_node(r);
  return NULL;
}

static case_t run(int node, const char *env, int preset) {
  case_t k = {.node = node, .preset = preset};
  if (env)
    setenv("DSV4_TEST_NUMA_OFF", env, 1);
  else
    unsetenv("DSV4_TEST_NUMA_OFF");
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, run_case, &k), 0);
  pthread_join(t, NULL);
  unsetenv("DSV4_TEST_NUMA_OFF");
  assert_int_equal(k.preset_rc, 0);
  assert_true(k.mapped);
  assert_true(k.child.mode != -2);
  /* The library's report of a page agrees with the kernel's, and has none for an unmapped one. */
  assert_int_equal(k.lib_first, k.first);
  assert_int_equal(k.lib_last, k.last);
  assert_int_equal(k.lib_gone, -1);
  return k;
}

/* The lowest node this process may use (a cpuset may leave out node 0), or skip where the kernel
 * answers no policy calls (no NUMA, or a container's filter). */
static int usable_node(void) {
  int n = policy_now().mode != -1 ? first_allowed_node() : -1;
  if (n < 0)
    skip();
  return n;
}

/* A node of the host's: preferred by the thread and its children, touched pages there. */
static void test_prefer(void **state) {
  (void)state;
  int n = usable_node();
  case_t k = run(n, NULL, 0);
  assert_int_equal(k.got, n);
  assert_int_equal(k.after.mode, MPOL_PREFERRED);
  assert_true(has_node(&k.after, n));
  assert_int_equal(k.child.mode, MPOL_PREFERRED);
  assert_true(has_node(&k.child, n));
  assert_int_equal(k.first, n);
  assert_int_equal(k.last, n);
  /* "0" is not "1": the preference is taken. */
  k = run(n, "0", 0);
  assert_int_equal(k.got, n);
  assert_int_equal(k.after.mode, MPOL_PREFERRED);
}

/* The highest node a mask holds is kept: with maxnode one short, the kernel would read an empty
 * mask for node 1023 and turn the preference into MPOL_LOCAL. Node 1023 exists on no host here,
 * so the kernel refuses it (EINVAL) rather than prefer it; what must never happen is a "preferred"
 * answer with the thread's policy something else. */
static void test_last_node(void **state) {
  (void)state;
  (void)usable_node();
  case_t k = run(1023, NULL, 0);
  if (k.got == 1023) {
    assert_int_equal(k.after.mode, MPOL_PREFERRED);
    assert_true(has_node(&k.after, 1023));
  } else {
    assert_int_equal(k.got, -1);
    assert_int_equal(k.after.mode, MPOL_DEFAULT);
  }
}

/* Nothing changes with the variable at 1, for a node out of range, or over a policy of its own. */
static void test_refused(void **state) {
  (void)state;
  int n = usable_node();
  static const int bad[] = {-1, -7, 1024, 5000};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    case_t k = run(bad[i], NULL, 0);
    assert_int_equal(k.got, -1);
    assert_int_equal(k.after.mode, MPOL_DEFAULT);
  }
  case_t k = run(n, "1", 0);
  assert_int_equal(k.got, -1);
  assert_int_equal(k.after.mode, MPOL_DEFAULT);
  assert_int_equal(k.child.mode, MPOL_DEFAULT);
  k = run(n, NULL, 1);
  assert_int_equal(k.got, -1);
  assert_int_equal(k.after.mode, MPOL_BIND);
  assert_true(has_node(&k.after, n));
  assert_int_equal(k.first, n);
}

/* Each PCIe function of this host as sysfs lists it (0000:00:1f.2), parsed and asked for again:
 * the same node as its numa_node file; a function that does not exist: -1. */
static void test_pci_node(void **state) {
  (void)state;
  DIR *d = opendir("/sys/bus/pci/devices");
  int seen = 0;
  if (d) {
    struct dirent *e;
    while ((e = readdir(d)) && seen < 64) {
      unsigned dom, bus, dev, fn;
      char path[512];
      int want = -1;
      if (sscanf(e->d_name, "%x:%x:%x.%x", &dom, &bus, &dev, &fn) != 4)
        continue;
      snprintf(path, sizeof(path), "/sys/bus/pci/devices/%s/numa_node", e->d_name);
      FILE *f = fopen(path, "r");
      if (!f)
        continue;
      if (fscanf(f, "%d", &want) != 1)
        want = -1;
      fclose(f);
      assert_int_equal(dsv4_pci_numa_node(dom, bus, dev, fn), want);
      seen++;
    }
    closedir(d);
  }
  printf("host_numa_test: %d PCIe functions compared\n", seen);
  assert_int_equal(dsv4_pci_numa_node(0xffff, 0xff, 0x1f, 7), -1);
}

/* A tree of devices as sysfs spells it, in a directory of the test's: the node a function's file
 * says, found by its parsed numbers (lower-case hex, the domain in four digits); a file without a
 * number, or no file, gives -1. */
static void test_pci_node_spelling(void **state) {
  (void)state;
  static const struct {
    const char *name, *text;
    unsigned dom, bus, dev, fn;
    int want;
  } fns[] = {
      {"0000:1a:00.0", "1\n", 0, 0x1a, 0, 0, 1},
      {"0001:c3:1f.7", "3\n", 1, 0xc3, 0x1f, 7, 3},
      {"0000:05:00.1", "-1\n", 0, 5, 0, 1, -1},
      {"0000:06:00.0", "x\n", 0, 6, 0, 0, -1},
  };
  char root[] = "/tmp/host_numa_test.XXXXXX", path[512];
  assert_non_null(mkdtemp(root));
  for (size_t i = 0; i < sizeof(fns) / sizeof(fns[0]); i++) {
    snprintf(path, sizeof(path), "%s/%s", root, fns[i].name);
    assert_int_equal(mkdir(path, 0700), 0);
    snprintf(path, sizeof(path), "%s/%s/numa_node", root, fns[i].name);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(fns[i].text, f);
    fclose(f);
  }
  for (size_t i = 0; i < sizeof(fns) / sizeof(fns[0]); i++)
    assert_int_equal(dsv4__pci_numa_node_in(root, fns[i].dom, fns[i].bus, fns[i].dev, fns[i].fn),
                     fns[i].want);
  assert_int_equal(dsv4__pci_numa_node_in(root, 0, 0x1b, 0, 0), -1);
  for (size_t i = 0; i < sizeof(fns) / sizeof(fns[0]); i++) {
    snprintf(path, sizeof(path), "%s/%s/numa_node", root, fns[i].name);
    unlink(path);
    snprintf(path, sizeof(path), "%s/%s", root, fns[i].name);
    rmdir(path);
  }
  rmdir(root);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_prefer),
      cmocka_unit_test(test_last_node),
      cmocka_unit_test(test_refused),
      cmocka_unit_test(test_pci_node),
      cmocka_unit_test(test_pci_node_spelling),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
