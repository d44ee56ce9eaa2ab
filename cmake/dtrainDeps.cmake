# spdlog, nlohmann-json, CLI11 and GoogleTest: the system packages, or else the copies
# scripts/carry.sh puts under DTRAIN_DEPS_DIR (default carry/) for machines without
# package access. Carried spdlog runs header-only on its own fmt 9.
set(DTRAIN_DEPS_DIR "${PROJECT_SOURCE_DIR}/carry" CACHE PATH
    "Carried dependencies (scripts/carry.sh), used when system packages are missing")

find_package(spdlog QUIET)
if(NOT spdlog_FOUND)
  if(NOT EXISTS "${DTRAIN_DEPS_DIR}/spdlog/include/spdlog/spdlog.h")
    message(FATAL_ERROR "dtrain: spdlog not found; run scripts/setup.sh (Debian libspdlog-dev) "
                        "or scripts/carry.sh on a machine that has it")
  endif()
  add_library(spdlog::spdlog INTERFACE IMPORTED)
  target_include_directories(spdlog::spdlog INTERFACE "${DTRAIN_DEPS_DIR}/spdlog/include")
  target_compile_definitions(spdlog::spdlog INTERFACE SPDLOG_HEADER_ONLY FMT_HEADER_ONLY)
  find_package(Threads REQUIRED)
  target_link_libraries(spdlog::spdlog INTERFACE Threads::Threads)
endif()

find_package(nlohmann_json QUIET)
if(NOT nlohmann_json_FOUND)
  find_path(DTRAIN_JSON_INCLUDE nlohmann/json.hpp HINTS "${DTRAIN_DEPS_DIR}/include" REQUIRED)
  add_library(nlohmann_json::nlohmann_json INTERFACE IMPORTED)
  target_include_directories(nlohmann_json::nlohmann_json INTERFACE "${DTRAIN_JSON_INCLUDE}")
endif()

find_package(CLI11 QUIET CONFIG)
if(NOT CLI11_FOUND)
  find_path(DTRAIN_CLI11_INCLUDE CLI/CLI.hpp HINTS "${DTRAIN_DEPS_DIR}/include" REQUIRED)
  add_library(CLI11::CLI11 INTERFACE IMPORTED)
  target_include_directories(CLI11::CLI11 INTERFACE "${DTRAIN_CLI11_INCLUDE}")
endif()

if(DTRAIN_BUILD_TESTS)
  find_package(GTest QUIET)
  if(NOT GTest_FOUND)
    if(NOT EXISTS "${DTRAIN_DEPS_DIR}/googletest/CMakeLists.txt")
      message(FATAL_ERROR "dtrain: GoogleTest not found; run scripts/setup.sh or scripts/carry.sh")
    endif()
    set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
    add_subdirectory("${DTRAIN_DEPS_DIR}/googletest" "${CMAKE_BINARY_DIR}/_deps/googletest"
                     EXCLUDE_FROM_ALL)
  endif()
endif()
