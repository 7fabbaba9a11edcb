# Thin front door over CMake. `make`, `make test`, `make bench`, `make test SAN=1`.
BUILD ?= build
ifeq ($(SAN),1)
BUILD := build-san
CMAKE_FLAGS += -DLINMOE_SAN=ON -DCMAKE_BUILD_TYPE=Debug
endif
JOBS ?= $(shell nproc)

.PHONY: all test bench clean configure
all: configure
	cmake --build $(BUILD) -j $(JOBS)

# Configure when the build system is missing: a configure that failed leaves a
# CMakeCache.txt but no Makefile, so that is what is tested (testing the cache kept
# failing with "No rule to make target 'Makefile'" until `make clean`). CMake's own
# status lines (CUDA or not) are shown, its full output only when it fails.
configure:
	@test -f $(BUILD)/Makefile || { mkdir -p $(BUILD) && \
	  if cmake -S . -B $(BUILD) $(CMAKE_FLAGS) >$(BUILD)/configure.log 2>&1; then \
	    grep -E '^-- linmoe' $(BUILD)/configure.log || true; \
	  else \
	    cat $(BUILD)/configure.log; rm -f $(BUILD)/Makefile; \
	    echo "make: configuring $(BUILD) failed (log: $(BUILD)/configure.log); fix the cause and run make again" >&2; \
	    exit 1; \
	  fi; }

test: all
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) $(CTEST_FLAGS)

bench: all
	$(BUILD)/linmoe bench kda --json $(BUILD)/bench-kda.json
	$(BUILD)/linmoe bench moe --json $(BUILD)/bench-moe.json
	$(BUILD)/linmoe bench attnres --json $(BUILD)/bench-attnres.json
	$(BUILD)/linmoe bench model --quick --json $(BUILD)/bench-model.json

clean:
	rm -rf build build-san
