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

/* A kernel without NUMA answers the policy calls with ENOSYS: nothing here can run. */
static int numa_kernel(void) {
  return policy_now().mode != -1;
}

typedef struct {
  int node;        /* asked for */
  const char *env; /* the off variable's value, or NULL for unset */
  int preset;      /* the thread binds itself to node 0 first, as numactl would */
  int got;         /* dsv4_host_prefer_node's answer */
  policy_t after;  /* the thread's policy after it */
  policy_t child;  /* a thread started after it */
  int first, last; /* nodes of the first and last pages of a region touched after it */
} case_t;

static void *read_policy(void *out) {
  *(policy_t *)out = policy_now();
  return NULL;
}

static void *run_case(void *arg) {
  case_t *k = arg;
  if (k->preset) {
    assert_int_equal(bind_node0(), 0);
  }
  k->got = dsv4_host_prefer_node(k->node, "DSV4_TEST_NUMA_OFF");
  k->after = policy_now();
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, read_policy, &k->child), 0);
  pthread_join(t, NULL);
  uint8_t *r = mmap(NULL, REGION, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  assert_true(r != MAP_FAILED);
  memset(r, 1, REGION);
  k->first = page_node(r);
  k->last = page_node(r + REGION - 1);
  /* The library's report of a page agrees with the kernel's, and has none for an unmapped one. */
  assert_int_equal(dsv4_page_numa_node(r), k->first);
  assert_int_equal(dsv4_page_numa_node(r + REGION - 1), k->last);
  munmap(r, REGION);
  assert_int_equal(dsv4_page_numa_node(r), -1);
  return NULL;
}

static case_t run(int node, const char *env, int preset) {
  case_t k = {.node = node, .env = env, .preset = preset};
  if (env)
    setenv("DSV4_TEST_NUMA_OFF", env, 1);
  else
    unsetenv("DSV4_TEST_NUMA_OFF");
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, run_case, &k), 0);
  pthread_join(t, NULL);
  unsetenv("DSV4_TEST_NUMA_OFF");
  return k;
}

/* Node 0, which every NUMA kernel has: preferred by the thread and its children, pages there. */
static void test_prefer(void **state) {
  (void)state;
  if (!numa_kernel())
    skip();
  case_t k = run(0, NULL, 0);
  assert_int_equal(k.got, 0);
  assert_int_equal(k.after.mode, MPOL_PREFERRED);
  assert_true(has_node(&k.after, 0));
  assert_int_equal(k.child.mode, MPOL_PREFERRED);
  assert_true(has_node(&k.child, 0));
  assert_int_equal(k.first, 0);
  assert_int_equal(k.last, 0);
  /* "0" is not "1": the preference is taken. */
  k = run(0, "0", 0);
  assert_int_equal(k.got, 0);
  assert_int_equal(k.after.mode, MPOL_PREFERRED);
}

/* Nothing changes with the variable at 1, for a node out of range, or over a policy of its own. */
static void test_refused(void **state) {
  (void)state;
  if (!numa_kernel())
    skip();
  static const int bad[] = {-1, -7, 1024, 5000};
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    case_t k = run(bad[i], NULL, 0);
    assert_int_equal(k.got, -1);
    assert_int_equal(k.after.mode, MPOL_DEFAULT);
  }
  case_t k = run(0, "1", 0);
  assert_int_equal(k.got, -1);
  assert_int_equal(k.after.mode, MPOL_DEFAULT);
  assert_int_equal(k.child.mode, MPOL_DEFAULT);
  k = run(0, NULL, 1);
  assert_int_equal(k.got, -1);
  assert_int_equal(k.after.mode, MPOL_BIND);
  assert_true(has_node(&k.after, 0));
  assert_int_equal(k.first, 0);
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
      cmocka_unit_test(test_refused),
      cmocka_unit_test(test_pci_node),
      cmocka_unit_test(test_pci_node_spelling),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
