# Provides ENTROKV_LLAMA_DIR: llama.cpp at commit 0c1e57098bba with native/patches applied.
#
# The source comes from (first that is set):
#   -DENTROKV_LLAMA_CPP_SOURCE=/path or env ENTROKV_LLAMA_CPP_SOURCE : an unpacked, unpatched llama.cpp tree
#   -DENTROKV_LLAMA_CPP_SDIST=/path  or env ENTROKV_LLAMA_CPP_SDIST  : llama_cpp_python-0.3.36.tar.gz
#   otherwise the sdist is fetched once with pip into the cache dir (env ENTROKV_CACHE_DIR,
#   default ~/.cache/entrokv-edge) and its sha256 is checked.
# The patched copy lives in the build dir; a change of the patch series restores and
# re-patches only the files the patches touch, so incremental builds stay incremental.

set(ENTROKV_LLAMA_PY_VERSION "0.3.36")
set(ENTROKV_LLAMA_SDIST_SHA256 "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e")
set(_sdist_name "llama_cpp_python-${ENTROKV_LLAMA_PY_VERSION}")

set(ENTROKV_LLAMA_CPP_SOURCE "$ENV{ENTROKV_LLAMA_CPP_SOURCE}" CACHE PATH "unpatched llama.cpp tree at 0c1e57098bba (offline builds)")
set(ENTROKV_LLAMA_CPP_SDIST  "$ENV{ENTROKV_LLAMA_CPP_SDIST}"  CACHE FILEPATH "${_sdist_name}.tar.gz (offline builds)")

set(_work "${CMAKE_BINARY_DIR}/_llama")
set(_pristine "${_work}/pristine")
set(ENTROKV_LLAMA_DIR "${_work}/src")

# the parts of the tree the library build needs
set(_parts CMakeLists.txt cmake ggml include src vendor common licenses LICENSE)

if(ENTROKV_LLAMA_CPP_SOURCE)
    if(NOT EXISTS "${ENTROKV_LLAMA_CPP_SOURCE}/src/llama-kv-cache.cpp")
        message(FATAL_ERROR "ENTROKV_LLAMA_CPP_SOURCE=${ENTROKV_LLAMA_CPP_SOURCE} is not a llama.cpp tree")
    endif()
    set(_origin "${ENTROKV_LLAMA_CPP_SOURCE}")
else()
    if(ENTROKV_LLAMA_CPP_SDIST)
        set(_sdist "${ENTROKV_LLAMA_CPP_SDIST}")
    else()
        if(DEFINED ENV{ENTROKV_CACHE_DIR})
            set(_cache "$ENV{ENTROKV_CACHE_DIR}")
        elseif(DEFINED ENV{XDG_CACHE_HOME})
            set(_cache "$ENV{XDG_CACHE_HOME}/entrokv-edge")
        else()
            set(_cache "$ENV{HOME}/.cache/entrokv-edge")
        endif()
        set(_sdist "${_cache}/sdist/${_sdist_name}.tar.gz")
        if(NOT EXISTS "${_sdist}")
            find_package(Python3 REQUIRED COMPONENTS Interpreter)
            message(STATUS "entrokv: fetching the llama-cpp-python ${ENTROKV_LLAMA_PY_VERSION} sdist (llama.cpp source) with pip")
            execute_process(
                COMMAND "${Python3_EXECUTABLE}" -m pip download --no-deps --no-build-isolation
                        --no-binary llama-cpp-python "llama-cpp-python==${ENTROKV_LLAMA_PY_VERSION}"
                        -d "${_cache}/sdist"
                RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
            if(NOT _rc EQUAL 0 OR NOT EXISTS "${_sdist}")
                message(FATAL_ERROR "entrokv: could not fetch the llama-cpp-python sdist with pip:\n${_err}\n"
                    "Offline: pass -DENTROKV_LLAMA_CPP_SDIST=/path/${_sdist_name}.tar.gz or ENTROKV_LLAMA_CPP_SOURCE=/path/llama.cpp")
            endif()
        endif()
    endif()
    file(SHA256 "${_sdist}" _sha)
    if(NOT _sha STREQUAL ENTROKV_LLAMA_SDIST_SHA256)
        message(FATAL_ERROR "entrokv: ${_sdist} has sha256 ${_sha}, expected ${ENTROKV_LLAMA_SDIST_SHA256}")
    endif()
    set(_origin "${_pristine}/${_sdist_name}/vendor/llama.cpp")
    if(NOT EXISTS "${_work}/pristine.stamp")
        file(REMOVE_RECURSE "${_pristine}")
        set(_patterns "")
        foreach(p IN LISTS _parts)
            list(APPEND _patterns "${_sdist_name}/vendor/llama.cpp/${p}")
        endforeach()
        message(STATUS "entrokv: unpacking llama.cpp from ${_sdist}")
        file(ARCHIVE_EXTRACT INPUT "${_sdist}" DESTINATION "${_pristine}" PATTERNS ${_patterns})
        file(WRITE "${_work}/pristine.stamp" "${_sha}\n")
    endif()
endif()

# the patch series and the files it touches
file(GLOB _patches "${CMAKE_CURRENT_LIST_DIR}/../native/patches/*.patch")
list(SORT _patches)
set(_hash_input "${_origin}\n")
set(_touched "")
foreach(p IN LISTS _patches)
    file(READ "${p}" _txt)
    string(APPEND _hash_input "${_txt}")
    string(REGEX MATCHALL "\n\\+\\+\\+ b/[^\n]+" _hits "\n${_txt}")
    foreach(h IN LISTS _hits)
        string(REGEX REPLACE "^\n\\+\\+\\+ b/" "" h "${h}")
        list(APPEND _touched "${h}")
    endforeach()
endforeach()
list(REMOVE_DUPLICATES _touched)
string(SHA256 _patch_hash "${_hash_input}")

set(_stamp "${_work}/patched.stamp")
set(_old_hash "")
set(_old_touched "")
if(EXISTS "${_stamp}" AND EXISTS "${ENTROKV_LLAMA_DIR}/src")
    file(STRINGS "${_stamp}" _lines)
    list(POP_FRONT _lines _old_hash)
    set(_old_touched ${_lines})
endif()

if(NOT _old_hash STREQUAL _patch_hash)
    if(NOT EXISTS "${ENTROKV_LLAMA_DIR}/src")
        message(STATUS "entrokv: copying llama.cpp into ${ENTROKV_LLAMA_DIR}")
        foreach(p IN LISTS _parts)
            if(EXISTS "${_origin}/${p}")
                file(COPY "${_origin}/${p}" DESTINATION "${ENTROKV_LLAMA_DIR}")
            endif()
        endforeach()
    else()
        # restore only what the old or new series touched
        set(_restore ${_old_touched} ${_touched})
        list(REMOVE_DUPLICATES _restore)
        foreach(f IN LISTS _restore)
            file(COPY_FILE "${_origin}/${f}" "${ENTROKV_LLAMA_DIR}/${f}")
        endforeach()
    endif()
    find_program(ENTROKV_PATCH_EXE patch)
    find_package(Git QUIET)
    foreach(p IN LISTS _patches)
        if(ENTROKV_PATCH_EXE)
            set(_cmd "${ENTROKV_PATCH_EXE}" -p1 --forward --batch -i "${p}")
        elseif(GIT_FOUND)
            # keep git from treating an enclosing checkout as the repository
            set(_cmd "${CMAKE_COMMAND}" -E env "GIT_CEILING_DIRECTORIES=${_work}"
                     "${GIT_EXECUTABLE}" apply --whitespace=nowarn "${p}")
        else()
            message(FATAL_ERROR "entrokv: need git or patch to apply ${p}")
        endif()
        execute_process(COMMAND ${_cmd} WORKING_DIRECTORY "${ENTROKV_LLAMA_DIR}"
                        RESULT_VARIABLE _rc ERROR_VARIABLE _err OUTPUT_VARIABLE _out)
        if(NOT _rc EQUAL 0)
            message(FATAL_ERROR "entrokv: patch ${p} does not apply to ${_origin}:\n${_out}${_err}")
        endif()
        message(STATUS "entrokv: applied ${p}")
    endforeach()
    string(REPLACE ";" "\n" _touched_lines "${_touched}")
    file(WRITE "${_stamp}" "${_patch_hash}\n${_touched_lines}\n")
endif()
