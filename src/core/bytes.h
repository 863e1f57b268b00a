// Little-endian byte codecs for wire frames and metadata blobs. ByteReader never reads past its
// input: every read checks the remaining length, and lengths read from the input are bounded by
// the caller's limit before anything is allocated.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "ferry/status.h"

namespace ferry {

class ByteWriter {
  public:
    void U8(uint8_t v) { buf_.push_back(static_cast<char>(v)); }
    void U16(uint16_t v) { Le(v); }
    void U32(uint32_t v) { Le(v); }
    void U64(uint64_t v) { Le(v); }
    void Raw(const void* p, size_t n) { buf_.append(static_cast<const char*>(p), n); }
    // u32 length, then the bytes.
    void Str(std::string_view s) {
        U32(static_cast<uint32_t>(s.size()));
        buf_.append(s.data(), s.size());
    }
    std::string& buffer() { return buf_; }
    std::string Take() { return std::move(buf_); }
    size_t size() const { return buf_.size(); }

  private:
    template <typename T>
    void Le(T v) {
        char b[sizeof(T)];
        for (size_t i = 0; i < sizeof(T); ++i) {
            b[i] = static_cast<char>((v >> (8 * i)) & 0xff);
        }
        buf_.append(b, sizeof(T));
    }
    std::string buf_;
};

class ByteReader {
  public:
    // `what` names the thing being decoded in error messages ("metadata", "write frame").
    ByteReader(std::string_view data, std::string_view what) : data_(data), what_(what) {}

    bool U8(uint8_t* v) { return Le(v); }
    bool U16(uint16_t* v) { return Le(v); }
    bool U32(uint32_t* v) { return Le(v); }
    bool U64(uint64_t* v) { return Le(v); }
    bool Raw(void* p, size_t n) {
        if (remaining() < n) {
            return Fail(n);
        }
        std::memcpy(p, data_.data() + pos_, n);
        pos_ += n;
        return true;
    }
    // Reads a u32-length-prefixed string of at most `max_len` bytes.
    bool Str(std::string* s, size_t max_len) {
        uint32_t n = 0;
        if (!U32(&n)) {
            return false;
        }
        if (n > max_len) {
            error_ = InvalidArgumentError(fmt_error("string of " + std::to_string(n) +
                                                    " bytes exceeds the limit of " +
                                                    std::to_string(max_len)));
            return false;
        }
        if (remaining() < n) {
            return Fail(n);
        }
        s->assign(data_.data() + pos_, n);
        pos_ += n;
        return true;
    }
    // Reads a u32 element count, bounded by `max_count` and by what the remaining input can hold
    // at `min_elem_size` bytes per element (so a lying count cannot force a huge allocation).
    bool Count(uint32_t* n, uint32_t max_count, size_t min_elem_size) {
        if (!U32(n)) {
            return false;
        }
        if (*n > max_count) {
            error_ = InvalidArgumentError(fmt_error("count " + std::to_string(*n) +
                                                    " exceeds the limit of " +
                                                    std::to_string(max_count)));
            return false;
        }
        if (min_elem_size > 0 && static_cast<uint64_t>(*n) * min_elem_size > remaining()) {
            return Fail(static_cast<uint64_t>(*n) * min_elem_size);
        }
        return true;
    }

    size_t remaining() const { return data_.size() - pos_; }
    size_t position() const { return pos_; }
    bool AtEnd() const { return pos_ == data_.size(); }

    // The first error seen; OK if none.
    const Status& error() const { return error_; }
    // Fails unless all input was consumed.
    Status Finish() {
        if (!error_.ok()) {
            return error_;
        }
        if (!AtEnd()) {
            return InvalidArgumentError(
                fmt_error(std::to_string(remaining()) + " unexpected trailing bytes"));
        }
        return Status::Ok();
    }
    void SetError(Status s) {
        if (error_.ok()) {
            error_ = std::move(s);
        }
    }

  private:
    template <typename T>
    bool Le(T* v) {
        if (remaining() < sizeof(T)) {
            return Fail(sizeof(T));
        }
        T out = 0;
        for (size_t i = 0; i < sizeof(T); ++i) {
            out |= static_cast<T>(static_cast<uint8_t>(data_[pos_ + i])) << (8 * i);
        }
        *v = out;
        pos_ += sizeof(T);
        return true;
    }
    bool Fail(uint64_t wanted) {
        SetError(InvalidArgumentError(fmt_error("truncated: wanted " + std::to_string(wanted) +
                                                " bytes at offset " + std::to_string(pos_) + ", " +
                                                std::to_string(remaining()) + " left")));
        return false;
    }
    std::string fmt_error(const std::string& m) const { return std::string(what_) + ": " + m; }

    std::string_view data_;
    std::string_view what_;
    size_t pos_ = 0;
    Status error_;
};

}  // namespace ferry
