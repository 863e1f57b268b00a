// GGUF (v3), the weights format of llama.cpp: typed key-value metadata, tensor descriptors and
// aligned tensor data in one file. GgufFile maps a file read-only and checks every length and
// offset against it before anything is used; GgufWriter writes one (tests and `ferry model
// init` make their models with it). Tensor types: F32, F16, BF16 (others are refused by name).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "ferry/status.h"

namespace ferry::gguf {

enum class GgufValueType : uint32_t {
    kUint8 = 0,
    kInt8 = 1,
    kUint16 = 2,
    kInt16 = 3,
    kUint32 = 4,
    kInt32 = 5,
    kFloat32 = 6,
    kBool = 7,
    kString = 8,
    kArray = 9,
    kUint64 = 10,
    kInt64 = 11,
    kFloat64 = 12,
};

enum class TensorType : uint32_t { kF32 = 0, kF16 = 1, kBF16 = 30 };
size_t TensorTypeSize(TensorType t);
std::string_view TensorTypeName(TensorType t);

// A metadata value: integers widen to int64/uint64, floats to double; arrays keep their element
// type (arrays of arrays are refused).
struct GgufValue {
    GgufValueType type = GgufValueType::kUint32;
    std::variant<uint64_t, int64_t, double, bool, std::string> scalar;
    GgufValueType element_type = GgufValueType::kUint32;  // kArray only
    std::vector<GgufValue> array;
};

struct GgufTensor {
    std::string name;
    std::vector<uint64_t> dims;  // ggml order: dims[0] varies fastest
    TensorType type = TensorType::kF32;
    uint64_t offset = 0;  // from the start of the data section
    uint64_t bytes = 0;
    const uint8_t* data = nullptr;  // into the mapping
    uint64_t elements() const;
};

class GgufFile {
  public:
    // Maps `path` and parses it. InvalidArgument naming the file, the offset and what was wrong
    // for anything malformed or truncated; NotFound if it cannot be opened.
    static Result<std::unique_ptr<GgufFile>> Open(const std::string& path);
    ~GgufFile();
    GgufFile(const GgufFile&) = delete;
    GgufFile& operator=(const GgufFile&) = delete;

    const std::string& path() const { return path_; }
    uint32_t version() const { return version_; }
    uint64_t alignment() const { return alignment_; }
    const std::map<std::string, GgufValue, std::less<>>& metadata() const { return metadata_; }
    const std::vector<GgufTensor>& tensors() const { return tensors_; }

    const GgufValue* Find(std::string_view key) const;
    const GgufTensor* FindTensor(std::string_view name) const;
    // Typed lookups: NotFound if missing, InvalidArgument if of another type.
    Result<std::string> GetString(std::string_view key) const;
    Result<uint64_t> GetUint(std::string_view key) const;  // any unsigned or non-negative int
    Result<double> GetFloat(std::string_view key) const;   // float32/float64
    Result<std::vector<std::string>> GetStringArray(std::string_view key) const;
    // Every tensor's name, type, offset, size and dims with the first and last 64 bytes of its
    // data: with a file's shape keys, enough to tell two random-weight files of one shape apart
    // (the model fingerprints) without reading gigabytes.
    std::string TensorSample() const;

  private:
    GgufFile() = default;
    Status Parse();

    std::string path_;
    const uint8_t* base_ = nullptr;
    size_t size_ = 0;
    uint32_t version_ = 0;
    uint64_t alignment_ = 32;
    std::map<std::string, GgufValue, std::less<>> metadata_;
    std::vector<GgufTensor> tensors_;
};

class GgufWriter {
  public:
    void SetString(std::string key, std::string value);
    void SetUint32(std::string key, uint32_t value);
    void SetUint64(std::string key, uint64_t value);
    void SetInt32(std::string key, int32_t value);
    void SetFloat32(std::string key, float value);
    void SetFloat64(std::string key, double value);
    void SetBool(std::string key, bool value);
    void SetStringArray(std::string key, std::vector<std::string> values);
    void SetInt32Array(std::string key, std::vector<int32_t> values);
    void SetFloat32Array(std::string key, std::vector<float> values);
    void SetFloat64Array(std::string key, std::vector<double> values);
    // A value as GgufFile parsed it, written back in its own type (copying metadata between
    // files: a model taking its tokenizer from another file). InvalidArgument for a value whose
    // payload does not fit its type.
    Status SetValue(std::string key, const GgufValue& value);
    // `data` holds elements(dims) values of `type`, little-endian.
    Status AddTensor(std::string name, std::vector<uint64_t> dims, TensorType type,
                     std::string data);
    // Writes the file (alignment 32), replacing `path` atomically.
    Status Write(const std::string& path) const;

  private:
    struct Entry {
        std::string key;
        std::string encoded;  // type + value
    };
    struct Tensor {
        std::string name;
        std::vector<uint64_t> dims;
        TensorType type;
        std::string data;
    };
    void Set(std::string key, std::string encoded);
    std::vector<Entry> entries_;
    std::vector<Tensor> tensors_;
};

}  // namespace ferry::gguf
