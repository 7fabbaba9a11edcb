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

configure:
	@test -f $(BUILD)/CMakeCache.txt || cmake -S . -B $(BUILD) $(CMAKE_FLAGS) >/dev/null

test: all
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) $(CTEST_FLAGS)

bench: all
	$(BUILD)/linmoe bench kda --json $(BUILD)/bench-kda.json
	$(BUILD)/linmoe bench moe --json $(BUILD)/bench-moe.json
	$(BUILD)/linmoe bench attnres --json $(BUILD)/bench-attnres.json
	$(BUILD)/linmoe bench model --quick --json $(BUILD)/bench-model.json

clean:
	rm -rf build build-san
