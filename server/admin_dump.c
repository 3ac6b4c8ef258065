/*
 * GET /admin/v1/dump?seq=S[&layers=a-b]: a sequence's stored records as a streamed safetensors file
 * (SPEC §6), a consistent snapshot at one batch boundary while the data plane keeps serving.
 *
 * The dump is a chain of executor jobs, one in the executor at a time, so a forward batch submitted
 * during a dump waits behind at most one step of admin_dump_chunk_bytes:
 *  1. snapshot: copy the sequence's block table and stored range per layer, and pin its blocks, so
 *     that a release, DELETE, expiry or device failure defers their return to the pool: nothing can
 *     reuse them, and positions once written are never rewritten, so the snapshot's bytes hold
 *     still for the whole dump while new positions keep arriving in later batches; where a layer
 *     runs the compressed branch, copy its state (entries, index records, ring rows: SPEC §8.9)
 *     into memory held until the head is built (entry blocks are not pinned; the state is bounded
 *     by the entry pools and one slot), and from then on in the file's last bytes;
 *  2. digest steps: the §3.1 sequence digest of each layer, a bounded run of records per step (the
 *     safetensors header carries the digests, so they come first);
 *  3. fill steps: the file's bytes in chunks, each into one of NBUF buffers; a buffer is written to
 *     the socket when filled, and the next fill is queued only once a buffer is free again, that is
 *     once its previous write completed: a slow client slows the dump down (back-pressure) and
 *     nothing beyond NBUF chunks is ever buffered (more than two, so that the socket never waits
 *     for the hand-over of a filled buffer from the executor to the loop);
 *  4. unpin, whether the dump completed, failed or the client went away.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "admin.h"
#include "dsv4-error.h"
#include "dsv4-layout.h"
#include "dump_format.h"
#include "engine_admin.h"
#include "engine_restore.h"
#include "log.h"
#include "records.h"
#include "safetensors.h"

typedef enum { ST_SNAPSHOT, ST_DIGEST, ST_FILL, ST_UNPIN } step_t;

/* Chunk buffers of a dump, filled and written in turn. */
#define NBUF 4u
typedef enum { BUF_FREE, BUF_FILLING, BUF_READY, BUF_WRITING } buf_state_t;

typedef struct {
  uint8_t *p;
  size_t len;
  buf_state_t state;
} dump_buf_t;

struct dsv4_dump {
  dsv4_job_t job; /* first; one job in the executor at a time */
  dsv4_daemon_t *d;
  dsv4_req_t *req; /* NULL once answered or ended */
  char seq[DSV4_SEQ_NAME_MAX + 1];
  uint32_t seq_len;
  uint32_t n;      /* layers in the dump */
  uint32_t *layer; /* [n] model layer numbers, ascending */
  uint32_t *idx;   /* [n] served index */
  int64_t *first;  /* [n] stored range [first, end) */
  int64_t *end;
  uint64_t *digest; /* [n] */
  uint64_t *off;    /* [n] file offset of the layer's records; its positions follow them */
  dsv4_seq_layer_state_t *state; /* [n_served] next and last segment, what a restore needs */
  /* [n] the compressed state of the layers that run the branch, copied at the snapshot (entry
   * blocks are not pinned: a DELETE during the dump frees them), then the file's last bytes. */
  dsv4_seq_cstate_t *cstate;
  uint8_t *ctail;
  size_t ctail_len;
  dsv4_seq_info_t info;
  int have_info, pinned, begun, failed, job_busy, write_busy;
  step_t step;
  int rc; /* of the last job */
  size_t chunk;
  /* Digest progress, per layer. */
  int64_t *dig_pos;                /* [n] next position to hash */
  dsv4_records_digest_t **rd;      /* [n] */
  dsv4_engine_digest_job_t *djobs; /* [n] one step's work */
  /* The file. */
  uint8_t *head;
  size_t head_len;
  uint64_t total, produced, sent;
  dump_buf_t buf[NBUF];
  uint64_t fill_k, write_k; /* chunks filled / written so far (buffer = k % NBUF) */
  uint64_t fill_off;
  size_t fill_len;
  uint64_t t_start, t_head; /* uv_hrtime at the request and when the head was ready */
};

typedef struct dsv4_dump dump_t;

static void pump(dump_t *dm);

static void dump_free(dump_t *dm) {
  if (dm->have_info)
    dsv4_seq_info_free(&dm->info);
  for (uint32_t i = 0; dm->rd && i < dm->n; i++)
    dsv4_records_digest_destroy(dm->rd[i]);
  free(dm->rd);
  free(dm->dig_pos);
  free(dm->djobs);
  free(dm->layer);
  free(dm->idx);
  free(dm->first);
  free(dm->end);
  free(dm->digest);
  free(dm->off);
  free(dm->state);
  for (uint32_t i = 0; dm->cstate && i < dm->n; i++)
    dsv4_engine_cstate_free(&dm->cstate[i]);
  free(dm->cstate);
  free(dm->ctail);
  free(dm->head);
  for (uint32_t i = 0; i < NBUF; i++)
    free(dm->buf[i].p);
  free(dm);
}

static uint64_t layer_records(const dump_t *dm, uint32_t i) {
  return (uint64_t)(dm->end[i] - dm->first[i]);
}

/* ---- executor thread ------------------------------------------------------------------------- */

static void snapshot(dump_t *dm) {
  dsv4_engine_t *e = dm->d->engine;
  const uint32_t bs = dsv4_engine_block_size(e);
  dsv4_engine_expire(e, uv_hrtime());
  dm->rc = dsv4_engine_seq_info(e, dm->seq, dm->seq_len, &dm->info);
  if (dm->rc)
    return;
  dm->have_info = 1;
  dsv4_seq_state_t ss = {0, dm->state};
  dm->rc = dsv4_engine_seq_state(e, dm->seq, dm->seq_len, &ss);
  if (dm->rc)
    return;
  for (uint32_t i = 0; i < dm->n; i++) {
    dsv4_seq_stored_range(&dm->info, bs, dm->idx[i], &dm->first[i], &dm->end[i]);
    dm->dig_pos[i] = dm->first[i];
    /* A layer with nothing stored has the digest of the empty list (no step will touch it). */
    dm->digest[i] = dsv4_records_digest_value(dm->rd[i]);
  }
  for (uint32_t i = 0; i < dm->n && !dm->rc; i++)
    dm->rc = dsv4_engine_read_cstate(e, dm->seq, dm->seq_len, dm->idx[i], &dm->cstate[i]);
  if (dm->rc)
    return;
  dm->rc = dsv4_engine_pin(e, &dm->info);
  dm->pinned = dm->rc == 0;
}

/*
 * One bounded step of the per-layer digests: at most chunk bytes of records in all, shared among
 * the layers not yet done, which progress side by side (on the backend's host threads when the
 * cache is in host memory).
 */
static void digest_step(dump_t *dm) {
  uint32_t budget = (uint32_t)(dm->chunk / DSV4_RECORD_BYTES), active = 0, k = 0;
  for (uint32_t i = 0; i < dm->n; i++)
    active += dm->dig_pos[i] < dm->end[i];
  if (active == 0)
    return;
  uint32_t share = budget / active ? budget / active : 1;
  for (uint32_t i = 0; i < dm->n; i++) {
    int64_t left = dm->end[i] - dm->dig_pos[i];
    if (left <= 0)
      continue;
    uint32_t m = left < (int64_t)share ? (uint32_t)left : share;
    dm->djobs[k++] =
        (dsv4_engine_digest_job_t){dm->idx[i], &dm->info, dm->dig_pos[i], m, dm->rd[i]};
  }
  dm->rc = dsv4_engine_digest_records_multi(dm->d->engine, dm->djobs, k);
  if (dm->rc)
    return;
  for (uint32_t j = 0, i = 0; j < k; j++) {
    while (dm->idx[i] != dm->djobs[j].idx)
      i++;
    dm->dig_pos[i] += dm->djobs[j].n;
    if (dm->dig_pos[i] == dm->end[i])
      dm->digest[i] = dsv4_records_digest_value(dm->rd[i]);
  }
}

static int digests_done(const dump_t *dm) {
  for (uint32_t i = 0; i < dm->n; i++)
    if (dm->dig_pos[i] < dm->end[i])
      return 0;
  return 1;
}

/* Bytes [off, off + len) of the file into dst. */
static int fill(dump_t *dm, uint64_t off, uint8_t *dst, size_t len) {
  dsv4_engine_t *e = dm->d->engine;
  while (len > 0) {
    size_t n;
    if (off < dm->head_len) {
      n = dm->head_len - off < len ? (size_t)(dm->head_len - off) : len;
      memcpy(dst, dm->head + off, n);
    } else if (off >= dm->total - dm->ctail_len) {
      /* The compressed state, copied at the snapshot. */
      uint64_t x = off - (dm->total - dm->ctail_len);
      n = dm->ctail_len - x < len ? (size_t)(dm->ctail_len - x) : len;
      memcpy(dst, dm->ctail + x, n);
    } else {
      uint32_t i = 0;
      while (i + 1 < dm->n && dm->off[i + 1] <= off)
        i++;
      uint64_t t = layer_records(dm, i);
      uint64_t pos_base = dm->off[i] + t * DSV4_RECORD_BYTES;
      if (off < pos_base) {
        uint64_t x = off - dm->off[i], k = x / DSV4_RECORD_BYTES;
        size_t within = (size_t)(x % DSV4_RECORD_BYTES);
        if (within == 0 && len >= DSV4_RECORD_BYTES) {
          uint64_t m = len / DSV4_RECORD_BYTES;
          if (m > t - k)
            m = t - k;
          int rc = dsv4_engine_read_records(e, dm->idx[i], &dm->info, dm->first[i] + (int64_t)k,
                                            (uint32_t)m, dst);
          if (rc)
            return rc;
          n = (size_t)m * DSV4_RECORD_BYTES;
        } else {
          /* A record cut by the chunk boundary. */
          uint8_t rec[DSV4_RECORD_BYTES];
          int rc =
              dsv4_engine_read_records(e, dm->idx[i], &dm->info, dm->first[i] + (int64_t)k, 1, rec);
          if (rc)
            return rc;
          n = DSV4_RECORD_BYTES - within < len ? DSV4_RECORD_BYTES - within : len;
          memcpy(dst, rec + within, n);
        }
      } else {
        uint64_t x = off - pos_base, k = x / 8;
        size_t within = (size_t)(x % 8);
        uint8_t le[8];
        dsv4_position_put(le, dm->first[i] + (int64_t)k);
        n = 8 - within < len ? 8 - within : len;
        memcpy(dst, le + within, n);
      }
    }
    dst += n;
    off += n;
    len -= n;
  }
  return 0;
}

static void dump_run(dsv4_job_t *job) {
  dump_t *dm = (dump_t *)job;
  dm->rc = 0;
  switch (dm->step) {
  case ST_SNAPSHOT:
    snapshot(dm);
    break;
  case ST_DIGEST:
    digest_step(dm);
    break;
  case ST_FILL:
    dm->rc = fill(dm, dm->fill_off, dm->buf[dm->fill_k % NBUF].p, dm->fill_len);
    break;
  case ST_UNPIN:
    dsv4_engine_unpin(dm->d->engine, &dm->info);
    dm->pinned = 0;
    break;
  }
}

/* ---- loop thread ----------------------------------------------------------------------------- */

static void dump_done(dsv4_job_t *job);

/* Queue the dump's next step. Continuation steps are never refused for a full queue: only one is
 * ever in the executor. Once the executor has stopped (shutdown), nothing can run: fail. */
static int submit_step(dump_t *dm, step_t step) {
  if (dm->d->ex.stopping)
    return DSV4_EDRAIN;
  dm->step = step;
  dm->job.run = dump_run;
  dm->job.done = dump_done;
  dm->job_busy = 1;
  dsv4_executor_submit_force(&dm->d->ex, &dm->job);
  return 0;
}

/* The stream is over (complete, failed or abandoned): answer or end it, then unpin and free. */
static void finish(dump_t *dm) {
  if (dm->begun) {
    uint64_t now = uv_hrtime();
    dsv4_logp(DSV4_LOG_INFO, "dump", "{s:s,s:i,s:I,s:I,s:b,s:f,s:f}", "seq", dm->seq, "layers",
              (int)dm->n, "bytes", (json_int_t)dm->total, "sent", (json_int_t)dm->sent, "complete",
              dm->sent == dm->total, "snapshot_digest_ms",
              (double)(dm->t_head - dm->t_start) * 1e-6, "stream_ms",
              (double)(now - dm->t_head) * 1e-6);
  }
  if (dm->req) {
    if (dm->begun)
      dsv4_respond_stream_end(dm->req);
    else
      dsv4_respond_error(dm->req, dm->rc ? dm->rc : DSV4_EIO, NULL, NULL);
    dm->req = NULL;
  }
  /* The next dump may start now: the executor runs this one's unpin before its snapshot. */
  if (dm->d->dump == dm)
    dm->d->dump = NULL;
  if (dm->pinned) {
    if (submit_step(dm, ST_UNPIN) == 0)
      return;
    /* The executor thread has been joined (shutdown): unpinning from here races nothing. */
    dsv4_engine_unpin(dm->d->engine, &dm->info);
    dm->pinned = 0;
  }
  dump_free(dm);
}

/* Answer an error found by the snapshot (unknown or expired sequence, ...) and clean up. */
static void fail_early(dump_t *dm) {
  if (dm->rc == DSV4_ENOSEQ || dm->rc == DSV4_EEXPIRED)
    dsv4__admin_seq_error(dm->d, dm->req, dm->rc, dm->seq);
  else
    dsv4_respond_error(dm->req, dm->rc, NULL, NULL);
  dm->req = NULL;
  finish(dm);
}

static int build_head(dump_t *dm) {
  dsv4_daemon_t *d = dm->d;
  char model[17];
  dsv4_seq_layer_state_t *ls = calloc(dm->n ? dm->n : 1, sizeof(*ls));
  if (!ls)
    return DSV4_ENOMEM;
  for (uint32_t i = 0; i < dm->n; i++)
    ls[i] = dm->state[dm->idx[i]];
  dsv4_dump_model_id(&d->cfg->model, model);
  dsv4_dump_desc_t dd = {
      .seq = dm->seq,
      .instance = d->instance,
      .model_id = model,
      .block_size = dsv4_engine_block_size(d->engine),
      .heads = d->cfg->heads,
      .head_offset = d->cfg->head_offset,
      .p0 = dm->info.p0,
      .n = dm->n,
      .layer = dm->layer,
      .first = dm->first,
      .end = dm->end,
      .digest = dm->digest,
      .layers = ls,
      .cstate = dsv4_engine_runs_compressed(d->engine) ? dm->cstate : NULL,
  };
  int rc = dsv4_dump_header(&dd, &dm->head, &dm->head_len, &dm->total, dm->off);
  if (!rc)
    rc = dsv4_dump_ctail(&dd, &dm->ctail, &dm->ctail_len);
  free(ls);
  /* The file now holds the state's bytes: the copies go. */
  for (uint32_t i = 0; i < dm->n; i++)
    dsv4_engine_cstate_free(&dm->cstate[i]);
  return rc;
}

static void start_stream(dump_t *dm) {
  char digests[24];
  dm->t_head = uv_hrtime();
  int rc = build_head(dm);
  if (rc) {
    dm->rc = rc;
    fail_early(dm);
    return;
  }
  snprintf(digests, sizeof(digests), "%u", dm->n);
  dsv4_hdr_t extra[1] = {{"Dsv4d-Dump-Layers", digests}};
  rc = dsv4_respond_stream_begin(dm->req, 200, "application/octet-stream", extra, 1, dm->total);
  dm->begun = 1;
  if (rc)
    dm->failed = 1;
  pump(dm);
}

static void on_piece_written(dsv4_req_t *req, int status, void *arg) {
  dump_t *dm = arg;
  (void)req;
  dump_buf_t *b = &dm->buf[dm->write_k % NBUF];
  dm->write_busy = 0;
  b->state = BUF_FREE;
  if (status) {
    dm->failed = 1;
  } else {
    dm->sent += b->len;
    dm->write_k++;
  }
  pump(dm);
}

/* Move the stream along: write a filled buffer, queue the next fill, or finish. */
static void pump(dump_t *dm) {
  if (!dm->failed && !dm->write_busy) {
    dump_buf_t *b = &dm->buf[dm->write_k % NBUF];
    if (b->state == BUF_READY) {
      uv_buf_t ub = uv_buf_init((char *)b->p, (unsigned)b->len);
      b->state = BUF_WRITING;
      dm->write_busy = 1;
      if (dsv4_respond_stream_write(dm->req, &ub, on_piece_written, dm)) {
        dm->write_busy = 0;
        dm->failed = 1;
      }
    }
  }
  if (!dm->failed && !dm->job_busy && dm->produced < dm->total) {
    dump_buf_t *b = &dm->buf[dm->fill_k % NBUF];
    if (b->state == BUF_FREE) {
      uint64_t left = dm->total - dm->produced;
      b->state = BUF_FILLING;
      b->len = left < dm->chunk ? (size_t)left : dm->chunk;
      dm->fill_off = dm->produced;
      dm->fill_len = b->len;
      dm->produced += b->len;
      if (submit_step(dm, ST_FILL))
        dm->failed = 1;
    }
  }
  if (dm->job_busy || dm->write_busy)
    return;
  if (dm->failed || dm->sent == dm->total)
    finish(dm);
}

static void dump_done(dsv4_job_t *job) {
  dump_t *dm = (dump_t *)job;
  dm->job_busy = 0;
  switch (dm->step) {
  case ST_UNPIN:
    dump_free(dm);
    return;
  case ST_SNAPSHOT:
  case ST_DIGEST:
    /* Before the head is sent a failure, or a client gone, is answered (or just freed). */
    if (!dm->rc && dsv4_req_gone(dm->req))
      dm->rc = DSV4_EIO;
    if (dm->rc) {
      fail_early(dm);
      return;
    }
    if (!digests_done(dm)) {
      /* Once the next step is queued the executor owns dm->rc: nothing here reads it again. */
      if (submit_step(dm, ST_DIGEST)) {
        dm->rc = DSV4_EDRAIN;
        fail_early(dm);
      }
      return;
    }
    start_stream(dm);
    return;
  case ST_FILL:
    if (dm->rc) {
      dsv4_logp(DSV4_LOG_ERROR, "dump: cannot read the cache", "{s:s,s:s}", "seq", dm->seq, "error",
                dsv4_strerror(dm->rc));
      dm->failed = 1;
    }
    dm->buf[dm->fill_k % NBUF].state = BUF_READY;
    dm->fill_k++;
    pump(dm);
    return;
  }
}

void dsv4__admin_on_dump(dsv4_req_t *req, void *ctx) {
  dsv4_daemon_t *d = ctx;
  dsv4_admin_query_t q;
  if (!d->admin_token && !d->admin_loopback) {
    dsv4_respond_error(req, DSV4_EFORBID,
                       "dumps need admin_token_file when the admin listener is not loopback", NULL);
    return;
  }
  if (dsv4__admin_query(d, req, DSV4_AQ_SEQ | DSV4_AQ_LAYERS, DSV4_AQ_SEQ, &q))
    return;
  if (d->dump) {
    dsv4_respond_error(req, DSV4_EDUMPBUSY, "another dump is streaming; one at a time",
                       json_pack("{s:s}", "seq", d->dump->seq));
    return;
  }
  /* Without layers=: every served layer. */
  uint32_t n = q.have & DSV4_AQ_LAYERS ? q.hi - q.lo + 1 : d->cfg->n_served;
  dump_t *dm = calloc(1, sizeof(*dm));
  if (!dm) {
    dsv4_respond_error(req, DSV4_ENOMEM, NULL, NULL);
    return;
  }
  dm->d = d;
  dm->req = req;
  memcpy(dm->seq, q.seq, q.seq_len + 1);
  dm->seq_len = q.seq_len;
  dm->n = n;
  dm->chunk = d->cfg->admin_dump_chunk_bytes;
  dm->layer = calloc(n, sizeof(*dm->layer));
  dm->idx = calloc(n, sizeof(*dm->idx));
  dm->first = calloc(n, sizeof(*dm->first));
  dm->end = calloc(n, sizeof(*dm->end));
  dm->digest = calloc(n, sizeof(*dm->digest));
  dm->off = calloc(n, sizeof(*dm->off));
  dm->state = calloc(d->cfg->n_served ? d->cfg->n_served : 1, sizeof(*dm->state));
  dm->cstate = calloc(n ? n : 1, sizeof(*dm->cstate));
  int bufs_ok = 1;
  for (uint32_t i = 0; i < NBUF; i++)
    bufs_ok &= (dm->buf[i].p = malloc(dm->chunk)) != NULL;
  if (!dm->layer || !dm->idx || !dm->first || !dm->end || !dm->digest || !dm->off || !dm->state ||
      !dm->cstate || !bufs_ok || !(dm->dig_pos = calloc(n, sizeof(*dm->dig_pos))) ||
      !(dm->rd = calloc(n, sizeof(*dm->rd))) || !(dm->djobs = calloc(n, sizeof(*dm->djobs)))) {
    dump_free(dm);
    dsv4_respond_error(req, DSV4_ENOMEM, NULL, NULL);
    return;
  }
  for (uint32_t i = 0; i < n; i++) {
    if (dsv4_records_digest_create(&dm->rd[i])) {
      dump_free(dm);
      dsv4_respond_error(req, DSV4_ENOMEM, NULL, NULL);
      return;
    }
    dm->layer[i] = q.have & DSV4_AQ_LAYERS ? q.lo + i : d->cfg->served_layers[i];
    dm->idx[i] = (uint32_t)dsv4_engine_layer_index(d->engine, dm->layer[i]);
  }
  dm->t_start = req->t_start_ns;
  dm->step = ST_SNAPSHOT;
  dm->job.run = dump_run;
  dm->job.done = dump_done;
  /* The first step queues like any request (queue_full when the executor is full). */
  int rc = dsv4_executor_submit(&d->ex, &dm->job);
  if (rc) {
    dump_free(dm);
    dsv4_respond_error(req, rc, NULL, NULL);
    return;
  }
  dm->job_busy = 1;
  d->dump = dm;
}
