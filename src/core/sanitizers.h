// Which sanitizer a build runs under, one spelling for GCC and clang: GCC defines
// __SANITIZE_ADDRESS__ and __SANITIZE_THREAD__; clang 14 defines only the first and answers
// __has_feature(thread_sanitizer) for the second (the sanitizer presets use clang since
// 2026-12-07: without this, a clang TSan build ran the release matrices and compiled out the
// socket annotations of core/tsan.h).
#pragma once

#if defined(__SANITIZE_ADDRESS__)
#define FERRY_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FERRY_ASAN 1
#endif
#endif

#if defined(__SANITIZE_THREAD__)
#define FERRY_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define FERRY_TSAN 1
#endif
#endif

#if defined(FERRY_ASAN) || defined(FERRY_TSAN)
#define FERRY_SANITIZED 1
#endif
