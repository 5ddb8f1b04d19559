# gradserve container image: CPU by default, GPU through build arguments.
#
#   CPU: docker build -t gradserve:cpu .
#   GPU: docker build -t gradserve:gpu \
#          --build-arg BASE_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04 \
#          --build-arg GRADSERVE_EXTRAS=gpu .
#
# The file needs only the classic builder (no BuildKit-only syntax), so it builds
# with any Docker engine. The stages:
#   python   the base image, plus python3 and venv from apt where the base has none
#            (CUDA runtime bases ship without Python);
#   builder  builds the gradserve wheel and installs it, with its dependencies and the
#            requested extras, into the virtual environment /opt/venv;
#   runtime  the base again, with /opt/venv copied in: no build tools, no wheels,
#            no pip caches, no pip; runs as an unprivileged user.

ARG BASE_IMAGE=python:3.11-slim

# --------------------------------------------------------------------------- python
FROM ${BASE_IMAGE} AS python
# gradserve needs Python >= 3.11. Official python:* images and Ubuntu 24.04 (CUDA
# "ubuntu24.04" bases, Python 3.12 from apt) qualify; Ubuntu 22.04's 3.10 does not,
# and the build stops here with a message saying so.
RUN set -eu; \
    if ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then \
        command -v apt-get >/dev/null 2>&1 || { \
            echo 'the base image has no python3 with venv, and no apt-get to install it' >&2; exit 1; }; \
        apt-get update; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            python3 python3-venv ca-certificates; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    python3 -c 'import sys; v = sys.version_info; sys.exit(0 if v >= (3, 11) else "gradserve needs Python >= 3.11; this base image has %d.%d" % v[:2])'

# -------------------------------------------------------------------------- builder
FROM python AS builder
# Comma-separated extras from pyproject.toml to install besides "server" and "xla" (which
# the image always has: the service, and its native tier, JAX on the CPU), e.g. "gpu"
# (cupy-cuda12x and JAX's CUDA 12 build, for a CUDA 12 base). Empty: the CPU image.
ARG GRADSERVE_EXTRAS=""
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1
RUN python3 -m venv /opt/venv
# A C compiler, and the Python headers where the base's Python comes without them, for
# setup.py's mypyc build of the graph compiler's hottest modules: in this stage only (the
# runtime stage copies /opt/venv, compiled modules included, and has no compiler).
RUN set -eu; \
    need=""; \
    command -v gcc >/dev/null 2>&1 || need="gcc libc6-dev"; \
    /opt/venv/bin/python -c 'import os, sysconfig; raise SystemExit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
        || need="$need python3-dev"; \
    if [ -n "$need" ]; then \
        apt-get update; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $need; \
        rm -rf /var/lib/apt/lists/*; \
    fi
WORKDIR /src

# Dependencies first, from pyproject.toml alone, so that a change to the code does not
# download them again (this layer is rebuilt only when pyproject.toml or the extras
# change).
COPY pyproject.toml ./
RUN /opt/venv/bin/python -c 'import os, tomllib; \
project = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
extras = ["server", "xla"] + [e.strip() for e in os.environ.get("GRADSERVE_EXTRAS", "").split(",") if e.strip()]; \
unknown = [e for e in extras if e not in project.get("optional-dependencies", {})]; \
assert not unknown, "unknown extras: %s" % unknown; \
reqs = project["dependencies"] + [r for e in extras for r in project["optional-dependencies"][e]]; \
open("/tmp/requirements.txt", "w").write("\n".join(reqs) + "\n")' \
    && cat /tmp/requirements.txt \
    && /opt/venv/bin/python -m pip install -r /tmp/requirements.txt

# Then the package itself, as a wheel (what a release would publish), its hottest modules
# compiled by mypyc (setup.py; mypy comes as a build requirement).
COPY README.md setup.py ./
COPY gradserve ./gradserve
COPY engine ./engine
COPY service ./service
COPY client ./client
COPY wire ./wire
RUN /opt/venv/bin/python -m pip wheel --no-deps --wheel-dir /tmp/dist . \
    && /opt/venv/bin/python -m pip install --no-deps /tmp/dist/gradserve-*.whl \
    && /opt/venv/bin/python -m pip check \
    && /opt/venv/bin/gradserve --help >/dev/null \
    && (cd / && /opt/venv/bin/python -c 'import gradserve.engine.graph as g; assert g.NATIVE, "not compiled"') \
    && /opt/venv/bin/python -m pip uninstall --yes pip setuptools wheel

# -------------------------------------------------------------------------- runtime
FROM python AS runtime
ARG GRADSERVE_EXTRAS=""
LABEL org.opencontainers.image.title="gradserve" \
      org.opencontainers.image.description="Gradient-computation microservice: PyTorch-style autodiff over JSON expression graphs" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.gradserve.extras="${GRADSERVE_EXTRAS}"

# A fixed numeric uid/gid, so that orchestrators can check runAsNonRoot. The home
# directory is writable for caches that libraries keep there (CuPy's kernel cache).
RUN groupadd --system --gid 10001 gradserve \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/gradserve \
       --shell /usr/sbin/nologin gradserve \
    && install -d -o 10001 -g 10001 -m 0700 /var/lib/gradserve/programs
# /var/lib/gradserve/programs: where a volume for the program store goes
# (GRADSERVE_PROGRAM_STORE_DIR; compose and deploy/ mount one). It is the service's own, so
# that a new named volume mounted there is too (Docker copies the mount point's owner).

# Owned by root: the service cannot modify its own code.
COPY --from=builder /opt/venv /opt/venv

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    GRADSERVE_HOST=0.0.0.0 \
    GRADSERVE_PORT=8000

USER 10001:10001
WORKDIR /home/gradserve
EXPOSE 8000

# Liveness with the standard library only (no curl in the image). urlopen raises on
# a refused connection, a timeout, or a non-2xx status, and python then exits 1.
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('GRADSERVE_PORT', '8000'), timeout=4)"]

# Exec form: gradserve (uvicorn) is PID 1 and receives SIGTERM itself; it stops
# accepting connections, finishes the requests in flight, and exits 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["gradserve"]
CMD ["serve"]
