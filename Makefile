# The two commands a new user runs (README): `make demo` and `make test`. Both install what is
# missing (Debian packages only), configure with CMake presets and build with Ninja.
PRESET ?= release
BUILD := build/$(PRESET)
JOBS ?= $(shell nproc)
# Tests run two per CPU: most of a multi-process test's time is waiting (process start-up, round
# trips, deadlines), so the suite's CPUs sat half idle at one per CPU (2026-12-07, 2 vCPUs: the
# release suite 251 s at -j2, 156 s at -j4; the TSan suite 608 s and 284 s; all green).
TEST_JOBS ?= $(shell echo $$(( $(JOBS) * 2 )))

.PHONY: demo test check-sanitizers fuzz soak soak-pd deps build format format-check bench clean

deps:
	@./scripts/install-deps

build: deps
	@cmake --preset $(PRESET) >/dev/null
	@cmake --build --preset $(PRESET) -j $(JOBS)

# The main job: serve a model on loopback colocated and disaggregated (prefill + decode workers
# behind ferry proxy, pull and push), check their answers token for token, run the serving
# benchmark at several request rates for each, the transfer benchmark on every backend, print
# the tables and write plots (demo-results/).
# Builds the one binary the demo runs, not the tests (most of a fresh build's time).
demo: deps
	@cmake --preset $(PRESET) >/dev/null
	@cmake --build --preset $(PRESET) -j $(JOBS) --target ferry
	@$(BUILD)/ferry demo

test: build format-check
	@ctest --preset $(PRESET) -j $(TEST_JOBS)

# The whole suite again under ASan+UBSan and under TSan; any report fails the run.
# UCX's memory hooks (libucm patches mmap/madvise at load) crash under ThreadSanitizer: off for
# the sanitizer builds (they only serve UCX's registration cache, unused over tcp). The build
# too: gtest_discover_tests runs every test binary to list its tests.
UCX_NO_HOOKS = UCX_MEM_EVENTS=no UCX_MEM_MALLOC_HOOKS=no UCX_MEM_MMAP_HOOK_MODE=none

check-sanitizers: deps
	@for p in asan tsan; do \
		cmake --preset $$p >/dev/null && $(UCX_NO_HOOKS) cmake --build --preset $$p -j $(JOBS) && \
		TSAN_OPTIONS="suppressions=$(CURDIR)/scripts/tsan.supp $$TSAN_OPTIONS" \
		$(UCX_NO_HOOKS) ctest --preset $$p -j $(TEST_JOBS) || exit 1; \
	done

# The nightly soak: a million verified transfers among 3 agent processes killed and restarted
# every 2 s (tests/soak/soak.cc; a 20 s run is part of `make test`).
SOAK_TRANSFERS ?= 1000000
soak: build
	@$(BUILD)/tests/ferry_soak --transfers $(SOAK_TRANSFERS) --kill-every-ms 2000

# The P/D soak's hour: 2 prefill, 2 decode and 1 encode worker behind ferry proxy under load
# (text and image requests) while they are killed, stopped and restarted; every answer checked
# against colocated (tests/soak/soak_pd.cc; a 60 s run is part of `make test`; docs/soak.md).
SOAK_PD_SECONDS ?= 3600
SOAK_PD_ARGS ?=
soak-pd: build
	@$(BUILD)/tests/ferry_soak_pd --duration-s $(SOAK_PD_SECONDS) $(SOAK_PD_ARGS)

# libFuzzer targets (clang, ASan+UBSan) for every decoder of outside input, FUZZ_SECONDS each.
FUZZ_SECONDS ?= 30
fuzz: deps
	@cmake --preset fuzz >/dev/null && $(UCX_NO_HOOKS) cmake --build --preset fuzz -j $(JOBS) --target fuzzers
	@$(UCX_NO_HOOKS) ./scripts/run-fuzzers $(FUZZ_SECONDS)

format-check: deps
	@./scripts/check-format

format:
	@git ls-files --cached --others --exclude-standard '*.h' '*.cc' | xargs clang-format -i

bench: build
	@$(BUILD)/ferry bench transfer --block-size 64K,4M --batch 1,32
	@$(BUILD)/ferry bench model --preset small

clean:
	rm -rf build
