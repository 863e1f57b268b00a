// msgpack (https://github.com/msgpack/msgpack/blob/master/spec.md), the little of it vLLM's KV
// events use: a writer in the forms msgspec writes (the shortest integer, str/bin/array/map
// headers by length, float64), and a reader of untrusted bytes that names what was wrong and
// never reads past the end or nests without bound.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "ferry/status.h"

namespace ferry {

class MsgpackWriter {
  public:
    void Nil();
    void Uint(uint64_t v);
    void Int(int64_t v);
    void Float(double v);
    void Str(std::string_view s);
    void Bin(const uint8_t* p, size_t n);
    void Array(size_t n);
    void Map(size_t n);
    std::string Take() { return std::move(out_); }

  private:
    void Header(size_t n, uint8_t fix, uint8_t b16, uint8_t b32);
    void Be(uint64_t v, int bytes);
    std::string out_;
};

class MsgpackReader {
  public:
    enum class Type { kNil, kBool, kInt, kFloat, kStr, kBin, kArray, kMap, kExt };
    explicit MsgpackReader(std::string_view data) : data_(data) {}

    bool done() const { return pos_ >= data_.size(); }
    size_t position() const { return pos_; }
    // The next value's type (InvalidArgument at the end or for a reserved byte).
    Result<Type> Peek() const;
    Status ReadNil();
    Result<uint64_t> ReadUint();  // a non-negative integer
    Result<int64_t> ReadInt();
    Result<double> ReadNumber();  // a float or an integer
    Result<std::string_view> ReadStr();
    Result<std::string_view> ReadBin();
    Result<size_t> ReadArray();  // the element count (bounded by the bytes left)
    Result<size_t> ReadMap();    // the pair count (bounded by the bytes left)
    // Skips one value of any type, nested at most `depth` deep.
    Status Skip(int depth = 32);

  private:
    Result<uint64_t> Be(size_t bytes);
    Result<size_t> Length(size_t bytes);
    Status Need(size_t n) const;
    std::string_view data_;
    size_t pos_ = 0;
};

}  // namespace ferry
