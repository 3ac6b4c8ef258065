"""dsv4ctl against a live daemon: every command next to the admin route it reads (the --json output
must be the route's document), the tables, exit codes, bearer tokens, dumps streamed to a file and
verified, and the README's "load a dump in Python" block run on a real dump.

dsv4ctl is found beside the daemon binary or in a directory above it (see ctl_path).
"""

import json
import os
import pty
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import xxhash

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Batch, Daemon, Seg, check, check_eq  # noqa: E402

HEADS = 8
README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "README.md")
SNIPPET_BEGIN = "<!-- dsv4ctl-readme-snippet: begin -->"
SNIPPET_END = "<!-- dsv4ctl-readme-snippet: end -->"
EMPTY_DIGEST = xxhash.xxh3_64_hexdigest(b"")


def ctl_path():
    """$DSV4CTL_BIN, else dsv4ctl in the daemon's directory or one above it (the build directory's
    root, where test-only daemon builds in tests/integration/ also find it)."""
    if os.environ.get("DSV4CTL_BIN"):
        return os.environ["DSV4CTL_BIN"]
    d = os.path.dirname(h.DAEMON)
    for _ in range(3):
        p = os.path.join(d, "dsv4ctl")
        if os.access(p, os.X_OK):
            return p
        d = os.path.dirname(d)
    raise h.TestFailure("no dsv4ctl beside %s or above it (set DSV4CTL_BIN)" % h.DAEMON)


def admin_url(d):
    d.admin_conn().close()  # waits for the admin listening line, fails without one
    return "http://127.0.0.1:%d" % d.admin_port


class Run:
    def __init__(self, p):
        self.rc, self.out, self.err = p.returncode, p.stdout, p.stderr

    def json(self):
        try:
            return json.loads(self.out)
        except ValueError as e:
            raise h.TestFailure("dsv4ctl --json printed no JSON (%s): %r / %r" %
                                (e, self.out[:300], self.err[:300]))

    def __repr__(self):
        return "Run(rc=%d, out=%r, err=%r)" % (self.rc, self.out[:400], self.err[:400])


def ctl(d, *args, env=None, admin=True):
    """Run dsv4ctl [--admin URL] args...; returns its exit code, stdout and stderr."""
    cmd = [ctl_path()] + (["--admin", admin_url(d)] if admin and d is not None else []) + list(args)
    e = {k: v for k, v in os.environ.items() if not k.startswith("DSV4CTL_")}
    e.update(env or {})
    p = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, env=e, timeout=60, universal_newlines=True)
    bad = [ln for ln in p.stderr.splitlines() if "runtime error:" in ln or "Sanitizer" in ln]
    check(not bad, "sanitizer report from dsv4ctl %s: %s" % (" ".join(args), "\n".join(bad[:5])))
    return Run(p)


def expect_rc(r, rc, what):
    if r.rc != rc:
        raise h.TestFailure("%s: dsv4ctl exit %d, expected %d: %r" % (what, r.rc, rc, r))


def without(doc, *keys):
    """A copy of a JSON document without the given keys at any depth (values that move with time)."""
    if isinstance(doc, dict):
        return {k: without(v, *keys) for k, v in doc.items() if k not in keys}
    if isinstance(doc, list):
        return [without(v, *keys) for v in doc]
    return doc


def same_doc(ctl_doc, route_doc, what, volatile=("idle_ms",)):
    check_eq(without(ctl_doc, *volatile), without(route_doc, *volatile), what)


def fill(d, rng, name="a", n=70, layers=range(4)):
    """One sequence written at every given layer (n tokens from 0, crossing a block boundary);
    returns the model's records per layer."""
    recs = {}
    for i, layer in enumerate(layers):
        b = Batch.random(rng, layer, [Seg(name, 0, n, i == 0)], HEADS)
        res = d.forward(b)
        h.check_result(res, b, "fill %s layer %d" % (name, layer))
        recs[layer] = h.model().records(b)
    return recs


# ---------------------------------------------------------------------------------------------------


def test_status_and_seq():
    with Daemon(h.SMALL) as d:
        rng = np.random.default_rng(11)
        fill(d, rng, "a", 70)
        fill(d, rng, "b", 3, layers=[0])

        r = ctl(d, "--json", "status")
        expect_rc(r, 0, "status --json")
        route = d.admin_json("/admin/v1/cache")
        same_doc(r.json(), route, "dsv4ctl --json status vs GET /admin/v1/cache")
        check_eq(route.get("instance"), d.instance, "cache instance")

        r = ctl(d, "status")
        expect_rc(r, 0, "status")
        check("instance         %s\n" % d.instance in r.out, "status table: %r" % r.out)
        check("layers           0-3 (4 served)\n" in r.out, "status layers line: %r" % r.out)
        used, free, total = route["blocks_used"], route["blocks_free"], route["kv_blocks"]
        check("blocks           %d used, %d free of %d" % (used, free, total) in r.out,
              "status blocks line: %r" % r.out)
        for layer, dg in route["pool_digests"].items():
            check(re.search(r"^\s*%s  %s$" % (layer, dg), r.out, re.M),
                  "status: pool digest of layer %s missing: %r" % (layer, r.out))

        r = ctl(d, "--json", "seq")
        expect_rc(r, 0, "seq --json")
        route = d.admin_json("/admin/v1/sequences")
        same_doc(r.json(), route, "dsv4ctl --json seq vs GET /admin/v1/sequences")
        check_eq([s["seq"] for s in route["sequences"]], ["a", "b"], "sequences, sorted")
        r = ctl(d, "seq")
        expect_rc(r, 0, "seq")
        lines = r.out.splitlines()
        check_eq(lines[0].split(), ["SEQ", "P0", "BLOCKS", "IDLE_MS", "NEXT"], "seq table head")
        check_eq(lines[1].split()[:3] + lines[1].split()[4:], ["a", "0", "2", "0-3:70"],
                 "seq table row a")
        check_eq(lines[2].split()[:3] + lines[2].split()[4:], ["b", "0", "1", "0:3", "1-3:0"],
                 "seq table row b (only layer 0 written)")
        check_eq(lines[-1], "2 sequence(s)", "seq table count")

        r = ctl(d, "--json", "seq", "a")
        expect_rc(r, 0, "seq a --json")
        route = d.admin_json("/admin/v1/sequences/a")
        same_doc(r.json(), route, "dsv4ctl --json seq a vs GET /admin/v1/sequences/a")
        r = ctl(d, "seq", "a")
        expect_rc(r, 0, "seq a")
        for bt in route["block_table"]:
            want = [str(bt[k]) for k in ("logical", "block", "first", "last")]
            check(any(ln.split() == want for ln in r.out.splitlines()),
                  "seq a: block table row %r missing: %r" % (want, r.out))
        for layer in range(4):
            want = [str(layer), "70", str(route["last_start"][str(layer)]), "0-69"]
            check(any(ln.split() == want for ln in r.out.splitlines()),
                  "seq a: layer %d row %r missing: %r" % (layer, want, r.out))

        # The daemon's errors: exit 1, code and message on stderr, the document with --json.
        r = ctl(d, "seq", "nope")
        expect_rc(r, 1, "seq of an unknown sequence")
        check("404 unknown_sequence" in r.err, "unknown sequence message: %r" % r.err)
        r = ctl(d, "--json", "seq", "nope")
        expect_rc(r, 1, "seq --json of an unknown sequence")
        check_eq(r.json()["error"]["code"], "unknown_sequence", "--json error document")
        # Usage errors never reach the daemon: exit 2.
        r = ctl(d, "seq", "bad/name")
        expect_rc(r, 2, "seq with a bad name")
        check("not a sequence name" in r.err, "bad name message: %r" % r.err)
        # The admin URL from the environment.
        r = ctl(d, "--json", "status", admin=False, env={"DSV4CTL_ADMIN": admin_url(d)})
        expect_rc(r, 0, "status with DSV4CTL_ADMIN")
        check_eq(r.json()["instance"], d.instance, "status through DSV4CTL_ADMIN")


def test_token_and_checksum():
    with Daemon(h.SMALL) as d:
        rng = np.random.default_rng(12)
        recs = fill(d, rng, "a", 70)
        for layer, pos in ((0, 0), (3, 69), (1, 64)):
            r = ctl(d, "--json", "token", "a", str(pos), "--layer", str(layer))
            expect_rc(r, 0, "token a %d --layer %d" % (pos, layer))
            route = d.admin_json("/admin/v1/sequences/a/tokens/%d?layer=%d" % (pos, layer))
            same_doc(r.json(), route, "dsv4ctl --json token vs the tokens route")
            rec = recs[layer][pos]
            check_eq(route["fp8"], rec[:448].tolist(), "token fp8 bytes vs the model")
            check_eq(route["record_digest"], h.model().mod.records_digest([pos], [rec]),
                     "record_digest vs the model")
            r = ctl(d, "token", "a", str(pos), "--layer", str(layer))
            expect_rc(r, 0, "token table")
            check("record_digest    %s\n" % route["record_digest"] in r.out, "token view: %r" % r.out)
            check("position %d  block %d  offset %d" % (pos, route["block"], route["offset"])
                  in r.out, "token view head: %r" % r.out)
            for g in range(7):
                check("NoPE dims %d-%d: scale code %d" % (64 * g, 64 * g + 63,
                                                           route["scale_codes"][g]) in r.out,
                      "token view group %d: %r" % (g, r.out[:500]))
        r = ctl(d, "token", "a", "70", "--layer", "0")
        expect_rc(r, 1, "token past the last written position")
        check("404 position_not_written" in r.err, "position_not_written: %r" % r.err)
        r = ctl(d, "token", "a", "0", "--layer", "9")
        expect_rc(r, 1, "token at a layer not served")
        check("400 unknown_layer" in r.err, "unknown_layer: %r" % r.err)

        for args, path in ((["--layer", "2"], "/admin/v1/checksums?layer=2"),
                           (["--layer", "2", "--seq", "a"], "/admin/v1/checksums?layer=2&seq=a")):
            r = ctl(d, "--json", "checksum", *args)
            expect_rc(r, 0, "checksum %r" % args)
            route = d.admin_json(path)
            same_doc(r.json(), route, "dsv4ctl --json checksum vs %s" % path)
            want = h.model().mod.records_digest(np.arange(70), recs[2])
            check_eq(route["sequences"]["a"]["digest"], want, "sequence digest vs the model")
            r = ctl(d, "checksum", *args)
            expect_rc(r, 0, "checksum table")
            check("layer 2  pool %s\n" % route["pool"] in r.out, "checksum head: %r" % r.out)
            check(any(ln.split() == ["a", "0", "69", "70", want] for ln in r.out.splitlines()),
                  "checksum sequence row: %r" % r.out)
            for b, dg in route["blocks"].items():
                check(any(ln.split() == [b, dg] for ln in r.out.splitlines()),
                      "checksum block row %s: %r" % (b, r.out))


def tty_stderr(cmd):
    """Run cmd with stderr on a pseudo-terminal; returns what it wrote there (exit status 0)."""
    master, slave = pty.openpty()
    try:
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=slave)
        os.close(slave)
        slave = -1
        got = b""
        while True:
            try:
                c = os.read(master, 65536)
            except OSError:  # EIO: the terminal's last writer has gone
                break
            if not c:
                break
            got += c
        check_eq(p.wait(60), 0, "%s: exit status" % " ".join(cmd))
        return got.decode("utf-8", "replace")
    finally:
        os.close(master)
        if slave >= 0:
            os.close(slave)


def read_dump(path):
    with open(path, "rb") as f:
        return h.parse_dump(f.read())


def test_dump_and_verify():
    with Daemon(h.SMALL) as d:
        rng = np.random.default_rng(13)
        recs = fill(d, rng, "a", 70)
        tmp = tempfile.mkdtemp(prefix="dsv4ctl-it-")
        path = os.path.join(tmp, "a.safetensors")

        r = ctl(d, "dump", "--seq", "a", "-o", path, "--progress")
        expect_rc(r, 0, "dump")
        check(not os.path.exists(path + ".part"), "the .part file is gone after a dump")
        check("all 4 layers match" in r.out, "dump verifies what it wrote: %r" % r.out)
        check("(100%)" in r.err, "progress line on stderr with --progress: %r" % r.err)
        check_eq(os.stat(path).st_mode & 0o777, 0o600, "dump file mode")
        meta, tensors = read_dump(path)
        route = d.admin("/admin/v1/dump?seq=a")
        check_eq(route.status, 200, "GET /admin/v1/dump")
        with open(path, "rb") as f:
            mine = f.read()
        check_eq(len(mine), len(route.body), "dump size: dsv4ctl's file vs the route")
        check(mine == route.body, "dsv4ctl's file is the route's body byte for byte")
        check_eq(meta.get("seq"), "a", "dump metadata seq")
        check_eq(meta.get("layers"), "0-3", "dump metadata layers")
        for layer in range(4):
            pos, rec = tensors[layer]
            check(np.array_equal(rec, recs[layer]), "dump records of layer %d vs the model" % layer)
            check_eq(pos.tolist(), list(range(70)), "dump positions of layer %d" % layer)
            ck = d.admin_json("/admin/v1/checksums?layer=%d&seq=a" % layer)
            check_eq(meta["digest.%d" % layer], ck["sequences"]["a"]["digest"],
                     "digest.%d vs the checksums route" % layer)

        # On a terminal the progress line is rewritten in place (carriage returns) and ends the
        # line when done; without one and without --progress there is none.
        os.unlink(path)
        tty = tty_stderr([ctl_path(), "--admin", admin_url(d), "dump", "--seq", "a", "-o", path])
        # (The terminal turns the final "\n" into "\r\n".)
        check(tty.startswith("\rdump a: ") and tty.endswith("\r\n") and tty.count("\n") == 1,
              "tty progress: one line rewritten in place: %r" % tty)
        check("(100%)" in tty.rsplit("\rdump a: ", 1)[1], "tty progress ends at 100%%: %r" % tty)
        r = ctl(d, "dump", "--seq", "a", "-o", path)
        expect_rc(r, 0, "dump without a terminal")
        check_eq(r.err, "", "no progress line without a terminal")

        r = ctl(d, "--json", "verify", path)
        expect_rc(r, 0, "verify")
        v = r.json()
        check_eq(v["ok"], True, "verify --json ok")
        check_eq([(x["layer"], x["records"], x["first"], x["last"], x["ok"]) for x in v["layers"]],
                 [(layer, 70, 0, 69, True) for layer in range(4)], "verify --json layers")
        check_eq([x["expected"] for x in v["layers"]], [meta["digest.%d" % i] for i in range(4)],
                 "verify --json expected digests")
        r = ctl(None, "verify", path)
        expect_rc(r, 0, "verify table")
        check_eq(r.out.splitlines()[1].split(),
                 ["LAYER", "RECORDS", "POSITIONS", "EXPECTED", "COMPUTED", "OK"], "verify head")

        # One byte of one record of layer 2 flipped: that layer fails, exit 1.
        d0 = 8 + int.from_bytes(mine[:8], "little")
        off = d0 + 2 * (70 * 584 + 70 * 8) + 17 * 584 + 3  # layer 2's records, record 17
        bad = bytearray(mine)
        bad[off] ^= 0x10
        bad_path = os.path.join(tmp, "bad.safetensors")
        with open(bad_path, "wb") as f:
            f.write(bad)
        r = ctl(None, "--json", "verify", bad_path)
        expect_rc(r, 1, "verify of a flipped byte")
        check_eq([x["ok"] for x in r.json()["layers"]], [True, True, False, True],
                 "only layer 2 fails")
        # Cut short, or not a dump: exit 2.
        with open(bad_path, "wb") as f:
            f.write(mine[:-1])
        r = ctl(None, "verify", bad_path)
        expect_rc(r, 2, "verify of a truncated dump")
        check("not a safetensors file" in r.err, "truncated dump message: %r" % r.err)

        # A range of layers; an empty layer range of a sequence written at layer 0 only.
        r = ctl(d, "--json", "dump", "--seq", "a", "--layers", "1-2", "-o", path)
        expect_rc(r, 0, "dump --layers 1-2")
        check_eq([x["layer"] for x in r.json()["layers"]], [1, 2], "dumped layers")
        meta, tensors = read_dump(path)
        check_eq(sorted(tensors), [1, 2], "layers dumped by --layers 1-2")

        # The daemon's refusals: nothing is left behind.
        os.unlink(path)
        for args, code in ((["--seq", "nope"], "404 unknown_sequence"),
                           (["--seq", "a", "--layers", "2-9"], "400 unknown_layer")):
            r = ctl(d, "dump", "-o", path, *args)
            expect_rc(r, 1, "dump %r" % args)
            check(code in r.err, "dump %r: %r" % (args, r.err))
            check(not os.path.exists(path) and not os.path.exists(path + ".part"),
                  "a refused dump leaves no file")
        shutil.rmtree(tmp, ignore_errors=True)


def test_dump_empty_layers():
    """Layers a sequence never wrote dump as T = 0 with the digest of the empty list (XXH3 of zero
    bytes), the same digest the checksums route gives, so they verify."""
    with Daemon(h.SMALL) as d:
        fill(d, np.random.default_rng(15), "z", 3, layers=[0])
        tmp = tempfile.mkdtemp(prefix="dsv4ctl-it-")
        path = os.path.join(tmp, "z.safetensors")
        try:
            for layer in (2, 3):
                ck = d.admin_json("/admin/v1/checksums?layer=%d&seq=z" % layer)["sequences"]["z"]
                check_eq((ck["records"], ck["digest"]), (0, EMPTY_DIGEST),
                         "checksums route: an empty layer's sequence digest")
            r = ctl(d, "--json", "dump", "--seq", "z", "--layers", "0-3", "-o", path)
            layers = r.json()["layers"] if r.out else []
            check_eq([(x["layer"], x["records"], x["expected"]) for x in layers],
                     [(0, 3, d.admin_json("/admin/v1/checksums?layer=0&seq=z")
                       ["sequences"]["z"]["digest"])] +
                     [(i, 0, EMPTY_DIGEST) for i in (1, 2, 3)],
                     "dump of layers never written: records and digest.{L} of each layer")
            expect_rc(r, 0, "dump with empty layers")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def test_dump_gapped_layers():
    """A daemon serving layers with a gap writes its dump's layers as runs ("0-1,3-3"); dsv4ctl dump
    accepts and verifies it, layer by layer, and verify FILE agrees."""
    args = [a if a != "0-3" else "0-1,3" for a in h.SMALL]
    with Daemon(args) as d:
        fill(d, np.random.default_rng(16), "g", 5, layers=[0, 1, 3])
        tmp = tempfile.mkdtemp(prefix="dsv4ctl-it-")
        path = os.path.join(tmp, "g.safetensors")
        try:
            r = ctl(d, "--json", "dump", "--seq", "g", "-o", path)
            expect_rc(r, 0, "dump of a gapped layer set")
            want = [(l, 5, d.admin_json("/admin/v1/checksums?layer=%d&seq=g" % l)
                     ["sequences"]["g"]["digest"]) for l in (0, 1, 3)]
            got = [(x["layer"], x["records"], x["expected"]) for x in r.json()["layers"]]
            check_eq(got, want, "gapped dump: layers, records and digests")
            check_eq(read_dump(path)[0]["layers"], "0-1,3-3", "gapped dump's metadata layers")
            v = ctl(d, "--json", "verify", path, admin=False)
            expect_rc(v, 0, "verify of a gapped dump")
            # The README's numpy loader reads the runs too.
            script = os.path.join(tmp, "snippet.py")
            with open(script, "w") as f:
                f.write(readme_snippet())
            p = subprocess.run([sys.executable, script, path], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, universal_newlines=True, timeout=60)
            check_eq(p.returncode, 0, "README snippet on a gapped dump (stderr %r)" % p.stderr[-800:])
            check_eq([ln.split() for ln in p.stdout.splitlines()],
                     [[str(l), "5", dg, "ok"] for l, _, dg in want],
                     "README snippet lines for the gapped dump")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def test_token_file():
    tmp = tempfile.mkdtemp(prefix="dsv4ctl-it-")
    tok = h.write_token_file(tmp, "admin-s3cret")
    try:
        with Daemon(h.SMALL + ["--admin-token-file", tok]) as d:
            r = ctl(d, "status")
            expect_rc(r, 1, "status without the token")
            check("401 unauthorized" in r.err and "(no --token-file given)" in r.err,
                  "401 message: %r" % r.err)
            r = ctl(d, "--token-file", tok, "--json", "status")
            expect_rc(r, 0, "status with --token-file")
            same_doc(r.json(), d.admin_json("/admin/v1/cache", token="admin-s3cret"),
                     "status with the token vs the route")
            r = ctl(d, "--json", "seq", env={"DSV4CTL_TOKEN_FILE": tok})
            expect_rc(r, 0, "seq with DSV4CTL_TOKEN_FILE")
            wrong = h.write_token_file(tmp, "admin-s3cres", name="wrong.token")
            r = ctl(d, "--token-file", wrong, "status")
            expect_rc(r, 1, "status with a wrong token")
            check("401 unauthorized" in r.err, "wrong token: %r" % r.err)
            r = ctl(d, "--token-file", os.path.join(tmp, "missing"), "status")
            expect_rc(r, 2, "status with a missing token file")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_no_daemon():
    # Connection refused: exit 2 naming the address.
    r = ctl(None, "status", admin=False, env={"DSV4CTL_ADMIN": "http://127.0.0.1:1"})
    expect_rc(r, 2, "status with nothing listening")
    check("cannot connect to 127.0.0.1:1" in r.err, "refused: %r" % r.err)


def readme_snippet():
    with open(README, encoding="utf-8") as f:
        text = f.read()
    check(SNIPPET_BEGIN in text and SNIPPET_END in text, "README lacks the marked dump snippet")
    block = text.split(SNIPPET_BEGIN, 1)[1].split(SNIPPET_END, 1)[0]
    m = re.search(r"```python\n(.*?)```", block, re.S)
    check(m is not None, "no ```python block between the README markers")
    return m.group(1)


def test_readme_snippet():
    """The README's plain-numpy loader, run by the tests' interpreter on a real dump, prints every
    layer's digest and it matches the metadata and the checksums route; its decoder gives the
    tokens route's dequantised values."""
    with Daemon(h.SMALL) as d:
        rng = np.random.default_rng(14)
        fill(d, rng, "a", 70)
        tmp = tempfile.mkdtemp(prefix="dsv4ctl-it-")
        path = os.path.join(tmp, "a.safetensors")
        script = os.path.join(tmp, "snippet.py")
        with open(script, "w") as f:
            f.write(readme_snippet())
        expect_rc(ctl(d, "dump", "--seq", "a", "-o", path), 0, "dump for the snippet")
        p = subprocess.run([sys.executable, script, path], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, universal_newlines=True, timeout=60)
        check_eq(p.returncode, 0, "README snippet exit status (stderr %r)" % p.stderr[-2000:])
        rows = [ln.split() for ln in p.stdout.splitlines()]
        check_eq(len(rows), 4, "README snippet: one line per layer: %r" % p.stdout)
        for layer, row in zip(range(4), rows):
            ck = d.admin_json("/admin/v1/checksums?layer=%d&seq=a" % layer)
            check_eq(row, [str(layer), "70", ck["sequences"]["a"]["digest"], "ok"],
                     "README snippet line for layer %d" % layer)

        # The decoder of the snippet against the tokens route, for a few records.
        g = {"__name__": "readme_snippet"}
        saved = sys.argv
        sys.argv = ["snippet", path]
        try:
            with open(os.devnull, "w") as null:
                old = sys.stdout
                sys.stdout = null
                try:
                    exec(compile(readme_snippet(), "README.md", "exec"), g)
                finally:
                    sys.stdout = old
        finally:
            sys.argv = saved
        meta, t = g["load_dump"](path)
        for layer, pos in ((0, 5), (3, 66)):
            nope, rope = g["decode"](t["layers.%d.records" % layer][pos:pos + 1])
            route = d.admin_json("/admin/v1/sequences/a/tokens/%d?layer=%d" % (pos, layer))
            check_eq(nope[0].tolist(), [float(x) for x in route["nope"]],
                     "snippet NoPE values vs the tokens route (layer %d pos %d)" % (layer, pos))
            check_eq(rope[0].tolist(), [float(x) for x in route["rope"]],
                     "snippet RoPE values vs the tokens route (layer %d pos %d)" % (layer, pos))
        shutil.rmtree(tmp, ignore_errors=True)


def seq_digests(d, name):
    """{layer: digest} of a sequence on a daemon, from /admin/v1/checksums."""
    return {l: d.admin_json("/admin/v1/checksums?layer=%d&seq=%s" % (l, name))["sequences"][name]
            ["digest"] for l in range(4)}


def test_snapshot_restore_migrate():
    with Daemon(h.SMALL, name="source") as d1, Daemon(h.SMALL, name="target") as d2, \
            Daemon(h.SMALL + ["--heads", "4"], name="other-heads") as d3:
        rng = np.random.default_rng(31)
        fill(d1, rng, "a", 150)
        want = seq_digests(d1, "a")
        tmp = tempfile.mkdtemp(prefix="dsv4ctl-snap-")
        try:
            f = os.path.join(tmp, "a.safetensors")
            r = ctl(d1, "snapshot", "--seq", "a", "-o", f, "--no-progress")
            expect_rc(r, 0, "snapshot")
            check("all 4 layers match" in r.out, "snapshot verified: %r" % r)
            check_eq(os.stat(f).st_mode & 0o777, 0o600, "snapshot file mode")

            r = ctl(d2, "restore", "--seq", "a", f)
            expect_rc(r, 0, "restore")
            check(r.out.startswith("restored a: p0 0, "), "restore table: %r" % r.out)
            for l in range(4):
                check("%d" % l in r.out and want[l] in r.out, "digest of layer %d printed" % l)
            check_eq(seq_digests(d2, "a"), want, "digests on the target")
            r = ctl(d2, "restore", "--seq", "a", f)
            expect_rc(r, 1, "restore over a live sequence")
            check("409 sequence_exists" in r.err, "sequence_exists named: %r" % r)
            r = ctl(d2, "--json", "restore", "--seq", "a", f, "--replace")
            expect_rc(r, 0, "restore --replace")
            check_eq(r.json()["replaced"], True, "replaced in --json")

            bad = os.path.join(tmp, "bad.safetensors")
            body = bytearray(open(f, "rb").read())
            body[-100] ^= 0x01  # a position of the last layer
            open(bad, "wb").write(bytes(body))
            r = ctl(d2, "restore", "--seq", "b", bad)
            expect_rc(r, 1, "restore of a corrupt file")
            check("400 " in r.err, "the daemon's refusal is printed: %r" % r)
            check(d2.seq("b") is None, "nothing restored from a corrupt file")
            r = ctl(d3, "restore", "--seq", "a", f)
            expect_rc(r, 1, "restore into other heads")
            check("409 geometry_mismatch" in r.err and "heads" in r.err, "geometry: %r" % r)

            # migrate: dump, restore on the target, digests compared there, delete here.
            fill(d1, rng, "m", 90)
            want_m = seq_digests(d1, "m")
            to = "127.0.0.1:%d" % d2.admin_port
            r = ctl(d1, "migrate", "--seq", "m", "--to", to)
            expect_rc(r, 0, "migrate")
            check(r.out.startswith("migrated m: "), "migrate output: %r" % r)
            check(d1.seq("m") is None, "gone from the source")
            check_eq(seq_digests(d2, "m"), want_m, "digests on the target after migrate")
            # The target already has a: it refuses, and the source keeps a.
            r = ctl(d1, "migrate", "--seq", "a", "--to", to)
            expect_rc(r, 1, "migrate onto a live name")
            check("the source is intact" in r.err, "says the source is intact: %r" % r)
            check_eq(seq_digests(d1, "a"), want, "a on the source after the refused migrate")
            to3 = "127.0.0.1:%d" % d3.admin_port
            r = ctl(d1, "migrate", "--seq", "a", "--to", to3)
            expect_rc(r, 1, "migrate to another geometry")
            check("geometry_mismatch" in r.err and "the source is intact" in r.err, "%r" % r)
            check(d3.seq("a") is None, "nothing on the other geometry")
            r = ctl(d1, "migrate", "--seq", "a", "--to", "127.0.0.1:1")
            expect_rc(r, 2, "migrate to nowhere")
            check("the source is intact" in r.err, "says so: %r" % r)
            check_eq(seq_digests(d1, "a"), want, "a on the source after a failed migrate")
            r = ctl(d1, "migrate", "--seq", "nobody", "--to", to)
            expect_rc(r, 1, "migrate of an unknown sequence")
            check("nothing changed" in r.err and "404 unknown_sequence" in r.err, "%r" % r)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    h.main([test_status_and_seq, test_token_and_checksum, test_dump_and_verify,
            test_dump_empty_layers, test_dump_gapped_layers, test_token_file, test_no_daemon, test_readme_snippet,
            test_snapshot_restore_migrate])
