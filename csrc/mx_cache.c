/*
 * A cache of large host buffers for the outputs of the CPU kernels, handed to PyTorch as
 * DLPack tensors.
 *
 * Why: glibc serves every block above its mmap threshold (at most 32 MiB) with a fresh mmap, so
 * each new output of a large quantization first takes one page fault per 4 KiB page, and the
 * kernel zeroes every page. On an 8192x4096 input that is 4x the cost of the quantization
 * itself. A training step quantizes the same shapes again and again: keeping freed output
 * buffers and handing them out again removes the faults, as PyTorch's own caching allocator
 * does for GPU memory.
 *
 * A buffer returns to the cache only when PyTorch frees the tensor's storage (the DLPack
 * deleter), so a buffer is never handed out while anything still uses it. The cache holds at
 * most `limit` bytes of free buffers; beyond that the least recently freed ones go back to the
 * system. Thread-safe: the deleter may run on any thread.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

/* DLPack v0.8 (the "dltensor" capsule every PyTorch >= 1.10 reads): the layout is ABI. */
typedef struct {
    void *data;
    int32_t device_type, device_id; /* kDLCPU = 1 */
    int32_t ndim;
    uint8_t code, bits; /* kDLUInt = 1, 8 bits */
    uint16_t lanes;
    int64_t *shape, *strides;
    uint64_t byte_offset;
} dl_tensor;

typedef struct dl_managed {
    dl_tensor tensor;
    void *manager_ctx;
    void (*deleter)(struct dl_managed *self);
} dl_managed;

typedef struct {
    dl_managed managed;
    int64_t length; /* the 1-D shape */
    size_t capacity;
} cached_tensor;

#define SLOTS 64
#define ALIGN 64

typedef struct {
    void *data;
    size_t capacity;
    uint64_t freed_at;
} free_buffer;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static free_buffer free_list[SLOTS];
static int nfree = 0;
static size_t free_bytes = 0, limit = (size_t)1 << 30;
static uint64_t clock_ticks = 0;

static void drop(int i) { /* caller holds the lock */
    free(free_list[i].data);
    free_bytes -= free_list[i].capacity;
    free_list[i] = free_list[--nfree];
}

static int oldest(void) {
    int o = 0;
    for (int i = 1; i < nfree; i++)
        if (free_list[i].freed_at < free_list[o].freed_at) o = i;
    return o;
}

static void give_back(void *data, size_t capacity) {
    pthread_mutex_lock(&lock);
    if (capacity > limit) {
        free(data);
    } else {
        while (nfree > 0 && (nfree == SLOTS || free_bytes + capacity > limit)) drop(oldest());
        free_list[nfree++] = (free_buffer){data, capacity, ++clock_ticks};
        free_bytes += capacity;
    }
    pthread_mutex_unlock(&lock);
}

/* The smallest free buffer that holds `bytes` without wasting more than a quarter of it. */
static void *take(size_t bytes, size_t *capacity) {
    void *data = 0;
    pthread_mutex_lock(&lock);
    int best = -1;
    for (int i = 0; i < nfree; i++) {
        size_t c = free_list[i].capacity;
        if (c >= bytes && c - bytes <= bytes / 4 && (best < 0 || c < free_list[best].capacity)) best = i;
    }
    if (best >= 0) {
        data = free_list[best].data;
        *capacity = free_list[best].capacity;
        free_bytes -= *capacity;
        free_list[best] = free_list[--nfree];
    }
    pthread_mutex_unlock(&lock);
    return data;
}

static void delete_tensor(dl_managed *self) {
    cached_tensor *t = (cached_tensor *)self;
    give_back(t->managed.tensor.data, t->capacity);
    free(t);
}

/* A new 1-D uint8 DLPack tensor of `bytes` bytes (64-byte aligned), from the cache when a
 * buffer fits; NULL when memory runs out. */
void *hp_cache_tensor(int64_t bytes) {
    cached_tensor *t = (cached_tensor *)calloc(1, sizeof(cached_tensor));
    if (!t) return 0;
    size_t want = ((size_t)bytes + ALIGN - 1) / ALIGN * ALIGN;
    size_t capacity = want;
    void *data = take(want, &capacity);
    if (!data) data = aligned_alloc(ALIGN, want ? want : ALIGN);
    if (!data) {
        free(t);
        return 0;
    }
    t->length = bytes;
    t->capacity = capacity;
    t->managed.tensor = (dl_tensor){data, 1, 0, 1, 1, 8, 1, &t->length, 0, 0};
    t->managed.deleter = delete_tensor;
    return t;
}

/* Frees a tensor from hp_cache_tensor that never reached PyTorch. */
void hp_cache_discard(void *tensor) { delete_tensor((dl_managed *)tensor); }

/* Sets the most free bytes the cache keeps (0 keeps none) and returns what it holds now. */
int64_t hp_cache_set_limit(int64_t bytes) {
    pthread_mutex_lock(&lock);
    limit = bytes > 0 ? (size_t)bytes : 0;
    while (nfree > 0 && free_bytes > limit) drop(oldest());
    int64_t held = (int64_t)free_bytes;
    pthread_mutex_unlock(&lock);
    return held;
}

/* Bytes of free buffers the cache holds. */
int64_t hp_cache_free_bytes(void) {
    pthread_mutex_lock(&lock);
    int64_t held = (int64_t)free_bytes;
    pthread_mutex_unlock(&lock);
    return held;
}
