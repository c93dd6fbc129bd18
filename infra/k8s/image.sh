#!/usr/bin/env bash
# Step 1 of docs/kubernetes.md, and the build/push steps of infra/k8s/prefect.yaml: build infra/Dockerfile and push
# it; `push` prints on stdout only the pushed image pinned by digest (<repo>@sha256:<digest>), which the deployments
# take as their `image` job variable (everything else goes to stderr).
#   EAGLE3_IMAGE_REPO=<registry>/eagle3-pipeline   build and push this checkout (docker with buildx/BuildKit)
#   EAGLE3_IMAGE=<repo>@sha256:<digest>            use an image already pushed (CI built it): no docker needed;
#   EAGLE3_IMAGE_REVISION=<git describe of its build> is then compared with this checkout's (a stale image refused)
#   EAGLE3_IMAGE_PLATFORM (default linux/amd64)     the GPU nodes' platform, whatever machine builds it
# The same sources give the same layers (docker's cache), so running it again pushes nothing new and prints the
# same digest: `prefect deploy --all` gives the same deployments every time.
set -euo pipefail
cmd=${1:?usage: image.sh build|push}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
if [[ -n "${EAGLE3_IMAGE:-}" ]]; then
  if [[ ! "$EAGLE3_IMAGE" =~ @sha256:[0-9a-f]{64}$ ]]; then
    echo "EAGLE3_IMAGE=$EAGLE3_IMAGE is not pinned by digest (<repo>@sha256:<64 hex digits>)" >&2; exit 2
  fi
  here=$(git -C "$root" describe --always --dirty --abbrev=12)
  if [[ -n "${EAGLE3_IMAGE_REVISION:-}" && "$EAGLE3_IMAGE_REVISION" != "$here" ]]; then
    echo "EAGLE3_IMAGE was built from $EAGLE3_IMAGE_REVISION, this checkout is $here: a stale image would run other" \
         "code than the deployments name; build and push this checkout (EAGLE3_IMAGE_REPO) or check it out" >&2; exit 2
  elif [[ -z "${EAGLE3_IMAGE_REVISION:-}" ]]; then
    echo "warning: EAGLE3_IMAGE is used as given; set EAGLE3_IMAGE_REVISION to the revision it was built from" \
         "(its org.opencontainers.image.revision label) to have it checked against this checkout ($here)" >&2
  fi
  [[ $cmd == push ]] && echo "$EAGLE3_IMAGE"
  exit 0
fi
repo=${EAGLE3_IMAGE_REPO:?set EAGLE3_IMAGE_REPO=<registry>/eagle3-pipeline to build and push, or EAGLE3_IMAGE=<repo>@sha256:<digest> of an image already pushed (docs/kubernetes.md step 1)}
tag=$(git -C "$root" describe --always --dirty --abbrev=12)
case $cmd in
  build)
    docker build --platform "${EAGLE3_IMAGE_PLATFORM:-linux/amd64}" --label "org.opencontainers.image.revision=$tag" \
      -f "$root/infra/Dockerfile" -t "$repo:$tag" "$root" >&2 ;;
  push)
    docker push "$repo:$tag" >&2
    ref=$(docker image inspect --format '{{range .RepoDigests}}{{println .}}{{end}}' "$repo:$tag" | grep -m1 "^$repo@sha256:" || true)
    [[ -n "$ref" ]] || { echo "no digest of $repo:$tag after the push" >&2; exit 1; }
    echo "$ref" ;;
  *) echo "usage: image.sh build|push" >&2; exit 2 ;;
esac
