#ifndef DSV4_SERVER_STARTUP_H
#define DSV4_SERVER_STARTUP_H

/*
 * The daemon as a function: dsv4d's main() is dsv4d_run, and test daemons (a CPU backend behind
 * device staging, a Level Zero test double) are the same function with a backend registered first.
 */

/* Run the daemon: parse argv (file < env < CLI), start, serve until drained; the exit status. */
int dsv4d_run(int argc, char **argv);

/* Open backend `to` whenever the configuration names backend `from` (call before dsv4d_run; both
 * strings must outlive it). For test daemons that stand a registered backend in for a real one. */
void dsv4d_backend_alias(const char *from, const char *to);

#endif /* DSV4_SERVER_STARTUP_H */
