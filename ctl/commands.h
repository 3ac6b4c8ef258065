#ifndef DSV4_CTL_COMMANDS_H
#define DSV4_CTL_COMMANDS_H

/*
 * The commands of dsv4ctl: each one GET of the admin plane (or, for verify, none), its answer
 * printed as a table or, with --json, as the daemon sent it; restore is one PUT of a dump file, and
 * migrate a dump from one daemon, a PUT to another, checksums on both and a DELETE on the first.
 *
 * Thread affinity: none; a call owns its connection and files.
 */

#include <stdio.h>

#include "args.h"

/*
 * Run the parsed command, printing results to out and messages to err. err_is_tty says whether a
 * dump shows its progress line by default. Returns the exit code (DSV4_CTL_EXIT_*).
 */
int dsv4_ctl_run(const dsv4_ctl_args_t *a, FILE *out, FILE *err, int err_is_tty);

#endif /* DSV4_CTL_COMMANDS_H */
