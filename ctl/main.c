/*
 * dsv4ctl: the operator's client of the dsv4d admin plane (SPEC §6). See `dsv4ctl --help`.
 */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "args.h"
#include "commands.h"

int main(int argc, char **argv) {
  dsv4_ctl_args_t a;
  char err[DSV4_CTL_ERR_LEN];
  if (dsv4_ctl_args_parse(argc, argv, getenv("DSV4CTL_ADMIN"), getenv("DSV4CTL_TOKEN_FILE"), &a,
                          err, sizeof(err)) != 0) {
    fprintf(stderr, "dsv4ctl: %s\n(dsv4ctl --help lists the commands)\n", err);
    return DSV4_CTL_EXIT_USAGE;
  }
  int rc = dsv4_ctl_run(&a, stdout, stderr, isatty(STDERR_FILENO));
  if (fflush(stdout) != 0 && rc == DSV4_CTL_EXIT_OK)
    rc = DSV4_CTL_EXIT_USAGE;
  return rc;
}
