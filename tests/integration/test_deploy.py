"""The deployment files against the daemon they deploy, without a cluster or Docker.

deploy/k8s: every manifest parses; the container ports, the probe paths, the Service, the
PodMonitor, the token files and the grace period agree with the ConfigMap's config.json; the daemon,
started on that config (listeners rewritten to loopback and port 0, the pool shrunk and the backend
set to the test's, token files replaced by test files), starts, answers 200 on the paths the probes
name and shows every key of the ConfigMap in GET /admin/v1/config. deploy/docker: the CPU image's
build stage runs the README's commands, and both images listen on every address through the daemon's
`host` option, expose the config's ports and check /healthz.
"""

import ipaddress
import json
import os
import posixpath
import re
import shlex
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dsv4_harness as h  # noqa: E402
from dsv4_harness import Daemon, check, check_eq  # noqa: E402

try:
    import yaml
except ImportError:  # a missing package is a failure, not a skip
    yaml = None

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
K8S = os.path.join(ROOT, "deploy", "k8s")
DOCKER = os.path.join(ROOT, "deploy", "docker")
TOKEN = "deploy-test-token"


# --------------------------------------------------------------------------------------------------
# deploy/k8s, read as kustomize reads it (resources and the two generators).


def kustomization():
    check(yaml is not None, "PyYAML is missing (deploy/install-deps.sh installs python3-yaml)")
    with open(os.path.join(K8S, "kustomization.yaml")) as f:
        return yaml.safe_load(f)


def manifests():
    """Every object of every resource file, as (file, object)."""
    k = kustomization()
    out = []
    for res in k.get("resources", []):
        with open(os.path.join(K8S, res)) as f:
            docs = [d for d in yaml.safe_load_all(f) if d is not None]
        check(docs, "%s holds no object" % res)
        for d in docs:
            for key in ("apiVersion", "kind", "metadata"):
                check(key in d, "%s: an object without %s" % (res, key))
            check(d["metadata"].get("name"), "%s: a %s without a name" % (res, d["kind"]))
            out.append((res, d))
    return out


def one(kind):
    objs = [d for _, d in manifests() if d["kind"] == kind]
    check_eq(len(objs), 1, "%s objects in deploy/k8s" % kind)
    return objs[0]


def generator(section, name):
    """A configMapGenerator or secretGenerator entry: {key: path relative to deploy/k8s}."""
    gens = [g for g in kustomization().get(section, []) if g.get("name") == name]
    check_eq(len(gens), 1, "%s entries named %s" % (section, name))
    files = {}
    for spec in gens[0].get("files", []):
        key, _, path = spec.partition("=") if "=" in spec else (posixpath.basename(spec), "", spec)
        files[key] = path
    return files


def pod_spec():
    return one("StatefulSet")["spec"]["template"]["spec"]


def container(spec, name):
    every = spec.get("containers", []) + spec.get("initContainers", [])
    cs = [c for c in every if c["name"] == name]
    check_eq(len(cs), 1, "containers named %s" % name)
    return cs[0]


def volume(spec, name):
    vs = [v for v in spec.get("volumes", []) if v["name"] == name]
    check_eq(len(vs), 1, "volumes named %s" % name)
    return vs[0]


def mount_of(c, path):
    """The volume mount of container c under which path lies (the deepest one)."""
    best = None
    for m in c.get("volumeMounts", []):
        mp = m["mountPath"].rstrip("/")
        if path == mp or path.startswith(mp + "/"):
            if best is None or len(mp) > len(best["mountPath"].rstrip("/")):
                best = m
    check(best is not None, "container %s mounts nothing at %s" % (c["name"], path))
    return best


def config_name():
    """The config file the daemon container reads, and the ConfigMap key behind it."""
    spec = pod_spec()
    c = container(spec, "dsv4d")
    args = c.get("args", [])
    check("--config" in args, "the daemon container names its config with --config: %r" % args)
    path = args[args.index("--config") + 1]
    m = mount_of(c, path)
    v = volume(spec, m["name"])
    check("configMap" in v, "the config file %s is not on a ConfigMap volume: %r" % (path, v))
    check_eq(v["configMap"]["name"], "dsv4d-config", "the config volume's ConfigMap")
    key = posixpath.relpath(path, m["mountPath"])
    return path, key


def configmap_config():
    _, key = config_name()
    files = generator("configMapGenerator", "dsv4d-config")
    check(key in files, "the ConfigMap has no key %s (it has %r)" % (key, sorted(files)))
    with open(os.path.join(K8S, files[key])) as f:
        cfg = json.load(f)
    check(isinstance(cfg, dict) and cfg, "the ConfigMap's %s is not a JSON object" % key)
    return cfg


def named_port(c, port):
    """A probe's or a Service's port (a name or a number) as the container's port number."""
    if isinstance(port, int):
        return port
    ps = [p["containerPort"] for p in c.get("ports", []) if p.get("name") == port]
    check_eq(len(ps), 1, "container ports named %r" % port)
    return ps[0]


def test_manifests_parse():
    kinds = sorted((d["apiVersion"], d["kind"]) for _, d in manifests())
    check_eq(kinds, [("apps/v1", "StatefulSet"), ("monitoring.coreos.com/v1", "PodMonitor"),
                     ("v1", "Service")], "objects in deploy/k8s")
    # No manifest escapes this test by being left out of the kustomization.
    listed = set(kustomization().get("resources", []))
    on_disk = {n for n in os.listdir(K8S) if n.endswith((".yaml", ".yml"))} - {"kustomization.yaml"}
    check_eq(on_disk - listed, set(), "YAML files in deploy/k8s that kustomization.yaml leaves out")


def test_manifests_match_config():
    cfg = configmap_config()
    sts = one("StatefulSet")
    spec = pod_spec()
    c = container(spec, "dsv4d")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    check_eq(ports, {"http": cfg["port"], "admin": cfg["admin_port"]}, "container ports")
    for host in ("host", "admin_host"):
        check(ipaddress.ip_address(cfg[host]).is_unspecified,
              "%s %r: a pod's daemon must listen on every address of the pod" % (host, cfg[host]))

    # Probes: data-plane paths (the admin listener has none) on the data port.
    want = {"startupProbe": "/healthz", "livenessProbe": "/healthz", "readinessProbe": "/readyz"}
    for probe, path in want.items():
        g = c[probe]["httpGet"]
        check_eq(g["path"], path, "%s path" % probe)
        check_eq(named_port(c, g["port"]), cfg["port"], "%s port" % probe)
    check_eq(c["resources"]["limits"].get("nvidia.com/gpu"), 1, "one GPU per daemon")
    check_eq(cfg.get("backend"), "cuda", "the GPU daemons' backend")
    check_eq(spec.get("enableServiceLinks"), False,
             "enableServiceLinks (service variables DSV4D_* would be read as options)")
    for e in c.get("env", []):
        check(not e["name"].startswith("DSV4D_"),
              "the config is the file's alone (env outranks it): env %s" % e["name"])

    # The grace period covers the preStop sleep and the drain (the arithmetic is in the manifest).
    pre = c["lifecycle"]["preStop"]["exec"]["command"]
    check(pre[0] == "sleep" and len(pre) == 2, "preStop is a sleep: %r" % pre)
    grace = spec["terminationGracePeriodSeconds"]
    need = int(pre[1]) + cfg.get("drain_timeout_ms", 30000) / 1000.0
    check(grace >= need + 5, "terminationGracePeriodSeconds %d < preStop %s s + drain %g s + 5 s"
          % (grace, pre[1], need - int(pre[1])))

    # snapshot_dir: a writable volume of its own per daemon (a volumeClaimTemplate), and the grace
    # period leaves the snapshot time beyond the drain (the manifest's arithmetic: 60 s).
    snap = cfg.get("snapshot_dir")
    check(snap, "config.json sets snapshot_dir (sequences survive a restart)")
    m = mount_of(c, snap)
    check(m is not None and not m.get("readOnly"), "snapshot_dir is on a writable mount: %r" % (m,))
    claims = [t["metadata"]["name"] for t in sts["spec"].get("volumeClaimTemplates", [])]
    check(m["name"] in claims, "snapshot_dir's volume %s is a volumeClaimTemplate (%r)" %
          (m["name"], claims))
    check(grace >= need + 5 + 60, "terminationGracePeriodSeconds %d leaves no snapshot time" % grace)

    # Token files: 0600 copies on a memory volume, made by the init container from the Secret.
    secret_files = generator("secretGenerator", "dsv4d-tokens")
    init = container(spec, "tokens")
    cmd = init["command"]
    check(cmd[:3] == ["install", "-m", "0600"] and "-t" in cmd, "the tokens copy: %r" % cmd)
    dest = cmd[cmd.index("-t") + 1]
    sources = [a for a in cmd[3:] if a not in ("-t", dest)]
    for opt in ("api_token_file", "admin_token_file"):
        path = cfg[opt]
        check_eq(posixpath.dirname(path), dest, "%s lies where the init container copies" % opt)
        m = mount_of(c, path)
        check(m.get("readOnly"), "the daemon mounts its tokens read-only")
        check_eq(mount_of(init, path)["name"], m["name"], "%s: one volume for both" % opt)
        check_eq(volume(spec, m["name"]).get("emptyDir", {}).get("medium"), "Memory",
                 "the tokens volume is memory-backed")
        base = posixpath.basename(path)
        src = [s for s in sources if posixpath.basename(s) == base]
        check_eq(len(src), 1, "the init container copies %s" % base)
        sm = mount_of(init, src[0])
        sv = volume(spec, sm["name"])["secret"]
        check_eq(sv["secretName"], "dsv4d-tokens", "the tokens' Secret")
        check_eq(sv.get("defaultMode"), 0o400, "the Secret's defaultMode")
        check(posixpath.relpath(src[0], sm["mountPath"]) in secret_files,
              "the Secret has no key %s (it has %r)" % (base, sorted(secret_files)))
    sc = spec["securityContext"]
    check(sc.get("runAsNonRoot") and sc.get("fsGroup"), "non-root, with an fsGroup: %r" % sc)

    # The Service and the PodMonitor find the pods and name the config's ports.
    labels = sts["spec"]["template"]["metadata"]["labels"]
    sel = sts["spec"]["selector"]["matchLabels"]
    check_eq({k: labels.get(k) for k in sel}, sel, "the StatefulSet's selector matches its pods")
    check_eq(labels.get("llm-d.ai/role"), "attention", "llm-d.ai/role")
    check("llm-d.ai/inferenceServing" not in labels,
          "llm-d.ai/inferenceServing would put the daemons among the model servers")
    svc = one("Service")
    check_eq(sts["spec"]["serviceName"], svc["metadata"]["name"], "the StatefulSet's serviceName")
    check_eq(svc["spec"].get("clusterIP"), "None", "the Service is headless")
    check_eq({k: labels.get(k) for k in svc["spec"]["selector"]}, svc["spec"]["selector"],
             "the Service's selector matches the pods")
    sports = {p["name"]: (p["port"], named_port(c, p["targetPort"])) for p in svc["spec"]["ports"]}
    check_eq(sports, {"http": (cfg["port"], cfg["port"]),
                      "admin": (cfg["admin_port"], cfg["admin_port"])}, "Service ports")
    pm = one("PodMonitor")
    msel = pm["spec"]["selector"]["matchLabels"]
    check_eq({k: labels.get(k) for k in msel}, msel, "the PodMonitor's selector matches the pods")
    eps = pm["spec"]["podMetricsEndpoints"]
    check_eq([(named_port(c, e["port"]), e["path"]) for e in eps], [(cfg["port"], "/metrics")],
             "the PodMonitor's endpoint")


def test_configmap_config_served():
    """The daemon on the ConfigMap's config: starts, answers the probes, shows every key."""
    cfg = configmap_config()
    c = container(pod_spec(), "dsv4d")
    work = tempfile.mkdtemp(prefix="dsv4d-it-deploy-")
    try:
        # Rewritten: listeners to loopback and port 0 (the harness also passes --host 127.0.0.1
        # --port 0 --admin-port 0), the pool to 64 block ids (65,536 would be 105 GB of address
        # space here), one thread, the test's backend, and token files the test wrote.
        test_cfg = dict(cfg)
        rewritten = {"host": "127.0.0.1", "port": 0, "admin_host": "127.0.0.1", "admin_port": 0,
                     "kv_blocks": 64, "threads": 1, "backend": h.BACKEND or "cpu",
                     "snapshot_dir": os.path.join(work, "snapshots")}
        os.makedirs(rewritten["snapshot_dir"])
        for opt in ("api_token_file", "admin_token_file"):
            if opt in cfg:
                rewritten[opt] = h.write_token_file(work, TOKEN, 0o600, opt + ".token")
        test_cfg.update({k: v for k, v in rewritten.items() if k in cfg})
        path = os.path.join(work, "config.json")
        with open(path, "w") as f:
            json.dump(test_cfg, f)
        with Daemon(["--config", path], name="configmap") as d:
            # The kubelet polls: /readyz answers 503 "restoring" until the snapshot directory has
            # been read.
            h.wait_ready(d)
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                p = c[probe]["httpGet"]["path"]
                r = d.get(p)
                check_eq(r.status, 200, "%s GET %s (body %r)" % (probe, p, r.body[:200]))
            r = d.get("/metrics")
            check_eq(r.status, 200, "GET /metrics, the PodMonitor's path")
            ms = h.parse_metrics(r.body.decode())
            check_eq(h.metric(ms, "dsv4d_kv_blocks_total", pool="swa"), 64.0, "dsv4d_kv_blocks_total")
            check_eq(h.metric(ms, "dsv4d_kv_block_size"), float(cfg.get("block_size", 64)),
                     "dsv4d_kv_block_size")
            token = TOKEN if "admin_token_file" in cfg else None
            opts = d.admin_json("/admin/v1/config", token=token)["options"]
            for key, value in cfg.items():
                check(key in opts, "ConfigMap key %s is not an option of the daemon" % key)
                if key in rewritten:
                    continue
                check_eq(opts[key]["value"], value, "option %s" % key)
                check_eq(opts[key]["source"], "file", "source of option %s" % key)
            check_eq(opts["config_file"]["value"], path, "the daemon read the config file")
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# deploy/docker


def dockerfile(name):
    """(stages): a list of stages, each a list of (INSTRUCTION, arguments) with continuations
    joined and comments dropped."""
    lines, cur = [], ""
    with open(os.path.join(DOCKER, name)) as f:
        for raw in f:
            s = raw.rstrip("\n")
            if not cur and s.lstrip().startswith("#"):
                continue
            if cur and s.lstrip().startswith("#"):
                continue  # a comment inside a continued instruction
            if s.endswith("\\"):
                cur += s[:-1] + " "
                continue
            cur += s
            if cur.strip():
                lines.append(cur.strip())
            cur = ""
    stages = []
    for ln in lines:
        instr, _, rest = ln.partition(" ")
        instr = instr.upper()
        if instr == "FROM":
            stages.append([])
        check(stages, "%s: %s before FROM" % (name, instr))
        stages[-1].append((instr, re.sub(r"\s+", " ", rest.strip())))
    return stages


def readme_commands():
    """The README's first command, split at &&: the set-up, the build and the run."""
    with open(os.path.join(ROOT, "README.md")) as f:
        for ln in f:
            if ln.startswith("    ./deploy/install-deps.sh"):
                return [s.strip() for s in ln.strip().split("&&")]
    raise h.TestFailure("the README has no command starting ./deploy/install-deps.sh")


def stage_runs(stage):
    return [s.strip() for instr, arg in stage if instr == "RUN" for s in arg.split("&&")]


def check_runtime_stage(name, build, runtime, cfg):
    workdir = [a for i, a in build if i == "WORKDIR"][-1]
    copies = [a.split() for i, a in runtime if i == "COPY" and a.startswith("--from=")]
    binary = posixpath.join(workdir, "build", "dsv4d")
    check(any(binary in c[1:-1] for c in copies),
          "%s: the runtime stage copies %s" % (name, binary))
    entry = json.loads([a for i, a in runtime if i == "ENTRYPOINT"][-1])
    check_eq(posixpath.basename(entry[0]), "dsv4d", "%s: ENTRYPOINT" % name)
    exposed = sorted(int(p.split("/")[0]) for i, a in runtime if i == "EXPOSE" for p in a.split())
    check_eq(exposed, sorted([cfg["port"], cfg["admin_port"]]),
             "%s: EXPOSE = the ConfigMap's ports" % name)
    hc = [a for i, a in runtime if i == "HEALTHCHECK"]
    check(len(hc) == 1 and "/healthz" in hc[0], "%s: HEALTHCHECK on /healthz: %r" % (name, hc))
    user = [a for i, a in runtime if i == "USER"][-1]
    uid = int(user.split(":")[0])
    check(uid != 0, "%s: runs as root" % name)
    check_eq(uid, pod_spec()["securityContext"]["runAsUser"],
             "%s: USER = the pods' runAsUser" % name)
    check_eq([a for i, a in runtime if i == "STOPSIGNAL"], ["SIGTERM"], "%s: STOPSIGNAL" % name)
    # The image's config file: DSV4D_CONFIG names the file a COPY puts there.
    env = dict(a.split("=", 1) for i, a in runtime if i == "ENV")
    target = env.get("DSV4D_CONFIG")
    check(target, "%s: no DSV4D_CONFIG" % name)
    srcs = [a.split() for i, a in runtime if i == "COPY" and not a.startswith("--")]
    src = [s[0] for s in srcs if s[-1] == target]
    check_eq(len(src), 1, "%s: a COPY to %s" % (name, target))
    check(not [k for k in env if k.startswith("DSV4D_") and k != "DSV4D_CONFIG"],
          "%s: options set in ENV outrank every config file: %r" % (name, env))
    with open(os.path.join(ROOT, src[0])) as f:
        return json.load(f)


def check_dockerignore(name):
    """The Dockerfile's own ignore file keeps a host build tree (cmake refuses its cache) and the
    operator's token files out of the build context."""
    with open(os.path.join(DOCKER, name + ".dockerignore")) as f:
        pats = {ln.strip() for ln in f if ln.strip() and not ln.startswith("#")}
    for p in ("/build*/", "/deploy/k8s/tokens/"):
        check(p in pats, "%s.dockerignore lacks %s" % (name, p))


def check_image_config(name, image_cfg):
    check(ipaddress.ip_address(image_cfg.get("host", "127.0.0.1")).is_unspecified,
          "%s: the image's config listens on every address: %r" % (name, image_cfg))
    # Every key is an option of the daemon: started on the file, the listener moved to loopback by
    # the harness's --host and --port, the backend set to the test's.
    work = tempfile.mkdtemp(prefix="dsv4d-it-image-")
    try:
        path = os.path.join(work, "config.json")
        test_cfg = dict(image_cfg, backend=h.BACKEND or "cpu")
        with open(path, "w") as f:
            json.dump(test_cfg, f)
        with Daemon(h.SMALL, env={"DSV4D_CONFIG": path}, name=name) as d:
            opts = d.admin_json("/admin/v1/config")["options"]
            for key in image_cfg:
                check(key in opts, "%s: key %s is not an option" % (name, key))
            check_eq(opts["host"]["source"], "cli", "%s: host source under the harness" % name)
            check_eq(opts["config_file"]["source"], "env", "%s: DSV4D_CONFIG read" % name)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_dockerfile_cpu():
    cfg = configmap_config()
    stages = dockerfile("Dockerfile.cpu")
    check_eq(len(stages), 2, "Dockerfile.cpu stages (build, runtime)")
    build, runtime = stages
    check_eq(build[0], ("FROM", "debian:bookworm AS build"), "Dockerfile.cpu build stage")
    check(runtime[0][1].startswith("debian:bookworm"), "Dockerfile.cpu runtime on Debian 12")
    readme = readme_commands()
    check_eq(readme[-1], "./build/dsv4d", "the README's first command ends by running the daemon")
    check_eq(stage_runs(build), readme[:-1],
             "Dockerfile.cpu's RUN commands against the README's build commands")
    apt = [a for i, a in runtime if i == "RUN" and "apt-get install" in a]
    check_eq(len(apt), 1, "Dockerfile.cpu: one apt-get install in the runtime stage")
    pkgs = {w for w in shlex.split(apt[0].split("apt-get install", 1)[1].split("&&")[0])
            if not w.startswith("-")}
    check_eq(pkgs, {"libuv1", "libjansson4", "libxxhash0", "libze1", "curl"},
             "Dockerfile.cpu runtime packages")
    check_dockerignore("Dockerfile.cpu")
    image_cfg = check_runtime_stage("Dockerfile.cpu", build, runtime, cfg)
    check_image_config("image-cpu", image_cfg)


def test_dockerfile_cuda():
    cfg = configmap_config()
    stages = dockerfile("Dockerfile.cuda")
    check_eq(len(stages), 2, "Dockerfile.cuda stages (build, runtime)")
    build, runtime = stages
    check(re.match(r"^nvidia/cuda:13\.0\.\d+-devel-ubuntu24\.04 AS build$", build[0][1]),
          "Dockerfile.cuda build image %r" % build[0][1])
    check(re.match(r"^nvidia/cuda:13\.0\.\d+-runtime-ubuntu24\.04$", runtime[0][1]),
          "Dockerfile.cuda runtime image %r" % runtime[0][1])
    check_eq(build[0][1].split(":")[1].split("-")[0], runtime[0][1].split(":")[1].split("-")[0],
             "one CUDA version for building and running")
    runs = stage_runs(build)
    cm = [r for r in runs if r.startswith("cmake -S . -B build")]
    check(cm and "-DDSV4_CUDA=ON" in cm[0].split(), "Dockerfile.cuda requires the CUDA backend")
    check(any(r.startswith("cmake --build build") for r in runs), "Dockerfile.cuda builds")
    check_dockerignore("Dockerfile.cuda")
    image_cfg = check_runtime_stage("Dockerfile.cuda", build, runtime, cfg)
    check_eq(image_cfg.get("backend"), "cuda", "the CUDA image's backend")
    check_image_config("image-cuda", image_cfg)


if __name__ == "__main__":
    h.main([test_manifests_parse, test_manifests_match_config, test_configmap_config_served,
            test_dockerfile_cpu, test_dockerfile_cuda])
