#ifndef DSV4_CTL_FMT_H
#define DSV4_CTL_FMT_H

/*
 * Human-readable views of the admin documents: aligned tables and key/value lines. Printers are
 * lenient about the documents they get (a field that is missing or of another type prints as "-"),
 * so a daemon of a slightly different version still shows what it has; --json is the exact form
 * for scripts.
 *
 * Thread affinity: none.
 */

#include <stddef.h>
#include <stdio.h>

#include <jansson.h>

#define DSV4_CTL_TABLE_MAX_COLS 8

/* Rows of text cells printed with each column as wide as its widest cell, two spaces apart. */
typedef struct {
  size_t ncols;
  const char *heads[DSV4_CTL_TABLE_MAX_COLS];
  unsigned right; /* bit c: right-align column c (numbers) */
  char **cells;   /* nrows * ncols, malloc'd */
  size_t nrows, cap;
  int oom; /* a row could not be stored: print says so */
} dsv4_ctl_table_t;

/* heads: ncols column titles (static strings). */
void dsv4_ctl_table_init(dsv4_ctl_table_t *t, size_t ncols, const char *const *heads,
                         unsigned right);
/* Append a row of ncols cells (copied; NULL prints as "-"). */
void dsv4_ctl_table_add(dsv4_ctl_table_t *t, const char *const *cells);
/* Print the header and the rows (no trailing spaces), then free the rows. */
void dsv4_ctl_table_print(dsv4_ctl_table_t *t, FILE *out);
void dsv4_ctl_table_free(dsv4_ctl_table_t *t);

/* A list of layer numbers as ranges, e.g. [0,1,2,3,43] -> "0-3,43" ("-" for none or not a list). */
void dsv4_ctl_format_layers(const json_t *list, char *out, size_t cap);
/* A JSON value as text: strings as they are, integers and reals in decimal, null and absent "-". */
void dsv4_ctl_format_value(const json_t *v, char *out, size_t cap);

/* The views of the commands (documents of the admin contract). */
void dsv4_ctl_print_cache(FILE *out, const json_t *doc);
void dsv4_ctl_print_sequences(FILE *out, const json_t *doc);
void dsv4_ctl_print_sequence(FILE *out, const json_t *doc);
void dsv4_ctl_print_token(FILE *out, const json_t *doc);
/* A compressed entry (GET /admin/v1/sequences/{seq}/entries/{j}): its record as a token's, then at
 * ratio 4 its index record, block by block. */
void dsv4_ctl_print_entry(FILE *out, const json_t *doc);
void dsv4_ctl_print_checksums(FILE *out, const json_t *doc);

/* One line describing a daemon's error answer: "404 unknown_sequence: message" (or the status and
 * the start of the body when it is not the contract's JSON error). */
void dsv4_ctl_format_error(int status, const char *body, size_t len, char *out, size_t cap);

#endif /* DSV4_CTL_FMT_H */
