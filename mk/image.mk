# Container image (docker/Dockerfile.ngc_pytorch): `make image`, `make image-sqsh`.
#   IMAGE=name:tag        image tag (default megatron-fp8:<version in pyproject.toml>)
#   BASE_IMAGE=...        NGC PyTorch base (default: the Dockerfile's ARG BASE_IMAGE, a CUDA 12.9 release)
#   CONTAINER_ENGINE=...  docker or podman (default: docker when installed, else podman)
#   IMAGE_BUILD_ARGS=...  extra build arguments, e.g. --build-arg MAX_JOBS=32 --no-cache
#   SQSH=path.sqsh        enroot squashfs for pyxis (default: <name>+<tag>.sqsh in the checkout)
IMAGE_DOCKERFILE ?= docker/Dockerfile.ngc_pytorch
IMAGE_VERSION := $(shell sed -n '/^version *= *"/{s/^version *= *"\(.*\)"/\1/p;q;}' pyproject.toml)
IMAGE ?= megatron-fp8:$(IMAGE_VERSION)
BASE_IMAGE ?= $(shell sed -n '/^ARG BASE_IMAGE=/{s/^ARG BASE_IMAGE=//p;q;}' $(IMAGE_DOCKERFILE))
CONTAINER_ENGINE ?= $(or $(notdir $(shell command -v docker 2>/dev/null)),$(notdir $(shell command -v podman 2>/dev/null)),docker)
IMAGE_BUILD_ARGS ?=
SQSH ?= $(subst :,+,$(subst /,+,$(IMAGE))).sqsh
# enroot reads the local image store of the engine that built it
ENROOT_SOURCE := $(if $(filter podman,$(CONTAINER_ENGINE)),podman,dockerd)://$(IMAGE)

.PHONY: image image-sqsh

image:
	@command -v $(CONTAINER_ENGINE) >/dev/null || { echo "make image: '$(CONTAINER_ENGINE)' not found: install docker or podman, or set CONTAINER_ENGINE" >&2; exit 1; }
	$(CONTAINER_ENGINE) build -f $(IMAGE_DOCKERFILE) --build-arg BASE_IMAGE=$(BASE_IMAGE) $(IMAGE_BUILD_ARGS) -t $(IMAGE) .
	@echo ">> built $(IMAGE) from $(BASE_IMAGE); for pyxis: make image-sqsh (or push it and set CONTAINER_IMAGE)"

image-sqsh: image
	@command -v enroot >/dev/null || { echo "make image-sqsh: enroot not found: install enroot (https://github.com/NVIDIA/enroot) on this machine" >&2; exit 1; }
	rm -f $(SQSH)
	enroot import -o $(SQSH) $(ENROOT_SOURCE)
	@echo ">> $(SQSH): CONTAINER_IMAGE=$(abspath $(SQSH)) sbatch slurm/test.sbatch"
