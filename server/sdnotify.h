#ifndef DSV4_SERVER_SDNOTIFY_H
#define DSV4_SERVER_SDNOTIFY_H

/*
 * The systemd readiness protocol (sd_notify(3)), written out because it is one datagram: when
 * $NOTIFY_SOCKET names a Unix datagram socket (a path, or "@name" for the abstract namespace), send
 * state to it, e.g. "READY=1" or "STOPPING=1". Without $NOTIFY_SOCKET it does nothing and returns
 * 0. Returns 0 or DSV4_EIO. Any thread.
 */
int dsv4_sd_notify(const char *state);

#endif /* DSV4_SERVER_SDNOTIFY_H */
